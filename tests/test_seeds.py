"""The seeds' ways of describing a model, on one group of 4 gloo ranks (start-up and imports paid once):
Parallelformers-style policies (tests/test_parallelformers.py), Paddle-style `parallelize`
(tests/test_parallelize.py) and the encoder-decoder models (tests/test_encoder_decoder.py)."""
from tests import test_encoder_decoder, test_parallelformers, test_parallelize
from tests.dist_utils import run_distributed


def _four_ranks(path: str) -> None:
    test_parallelformers.four_ranks()
    test_parallelize.four_ranks()
    test_encoder_decoder.four_ranks(path)


def test_seeds_on_four_ranks(tmp_path):
    run_distributed(4, _four_ranks, str(tmp_path / "checkpoints"))
