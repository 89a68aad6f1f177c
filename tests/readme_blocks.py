"""The README's worked examples, as code the tests run."""
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(heading: str) -> str:
    """The first ```python block after the README heading that starts with `heading`."""
    text = README.read_text()
    start = text.index("\n" + heading)
    begin = text.index("```python\n", start) + len("```python\n")
    return text[begin:text.index("```", begin)]
