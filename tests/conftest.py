"""HP_TEST_DEVICE=cuda (`make gpu-check`): the tests marked `cuda` run, their worlds of one on the GPU with NCCL;
the others are CPU/gloo tests of several ranks or of host-side logic, skipped there with the reason (CI runs them)."""
import pytest

from tests.dist_utils import TEST_DEVICE


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: runs on the GPU under HP_TEST_DEVICE=cuda (and on CPU otherwise)")


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE != "cuda":
        return
    skip = pytest.mark.skip(reason="a CPU test (several gloo ranks or host-side logic): HP_TEST_DEVICE=cuda runs "
                                   "the tests marked cuda")
    for item in items:
        if "cuda" not in item.keywords:
            item.add_marker(skip)
