r"""ColossalAI's module paths over this library: `import booster_plugin.colossalai` stands for `import colossalai`.

The port of a ColossalAI script is one mechanical substitution of the word `colossalai`:

    sed -i -E 's/\bcolossalai\b/booster_plugin.colossalai/g' train.py

Every submodule here re-exports this library's counterpart under ColossalAI's name, or a thin adapter with
ColossalAI's arguments; a name with no counterpart imports and raises NotImplementedError with the reason when used
(_refused.py). docs/colossalai_inventory.md lists each name ColossalAI's training scripts and its own tests import
(`testing`, `interface`, `shardformer.layer`, ...) and what stands for it, or why nothing does.
"""
from importlib.metadata import PackageNotFoundError, version

from . import accelerator
from .initialize import launch, launch_from_torch

try:
    __version__ = version("hybrid-parallel")
except PackageNotFoundError:  # run from a source tree without `pip install -e .`
    __version__ = "0.0.0"

__all__ = ["accelerator", "launch", "launch_from_torch", "__version__"]
