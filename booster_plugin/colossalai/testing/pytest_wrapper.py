"""`colossalai.testing.pytest_wrapper.run_on_environment_flag`."""
import os

__all__ = ["run_on_environment_flag"]


def run_on_environment_flag(name: str):
    """A pytest mark that runs the test only when the environment variable `name` (upper-cased) is "1"."""
    import pytest

    flag = os.environ.get(name.upper(), "0")
    return pytest.mark.skipif(flag != "1", reason=f"Environment variable {name} is {flag}")
