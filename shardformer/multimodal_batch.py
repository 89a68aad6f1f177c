"""Microbatches of a vision-language batch: inputs whose dim 0 counts images or patches, not samples.

A family's processor lays its image inputs out in one of a few ways; each is data here (`FAMILIES`, by
`config.model_type`):
- one row per image (LLaVA, Gemma 3, Mistral3: `pixel_values` (images, C, H, W), `image_sizes`);
- Qwen-VL's flattened patches: `pixel_values` (patches, C*T*P*P) and one `image_grid_thw` row (t, h, w) per image,
  whose patches are t*h*w and whose placeholder tokens t*h*w / merge**2 (likewise videos);
- one row per sample (Idefics3 / SmolVLM: `pixel_values` (batch, images, C, H, W)): nothing to do.
Which images belong to which sample follows from the placeholder tokens in `input_ids` (the model's own rule: the
k-th image's features replace the k-th run of its tokens, in sample order). `image_rows(config)` gives, for a batch,
a function per such key taking the rows of samples [start, end); microbatches.py and the tests split with it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from pipeline.step import MicroBatch

__all__ = ["FAMILIES", "ImageInputs", "RaggedRows", "image_rows", "take_samples"]

# batch -> {key: rows(start, end)} for the keys whose dim 0 does not count samples (None: none for those samples)
RaggedRows = Callable[[Mapping[str, Any]], Dict[str, Callable[[int, int], Optional[torch.Tensor]]]]


class ImageInputs(NamedTuple):
    """How one kind of image input (images, videos) indexes its rows."""
    token: str                       # config attribute: the placeholder token id of its features
    per_image: Tuple[str, ...]       # keys whose dim 0 counts images (videos), in sample order
    per_patch: Tuple[str, ...] = ()  # keys whose dim 0 counts patches: prod(grid) per image
    grid: Optional[str] = None       # key of the (t, h, w) grid per image; its tokens: prod(grid) / merge**2
    merge: Optional[str] = None      # config attribute (dotted) of the spatial merge size


_PER_IMAGE = (ImageInputs("image_token_id", ("pixel_values", "image_sizes")),)
_QWEN_VL = (ImageInputs("image_token_id", ("image_grid_thw",), ("pixel_values",), "image_grid_thw",
                        "vision_config.spatial_merge_size"),
            ImageInputs("video_token_id", ("video_grid_thw", "second_per_grid_ts"), ("pixel_values_videos",),
                        "video_grid_thw", "vision_config.spatial_merge_size"))
FAMILIES: Dict[str, Tuple[ImageInputs, ...]] = {
    "llava": _PER_IMAGE, "blip-2": _PER_IMAGE, "gemma3": _PER_IMAGE, "mistral3": _PER_IMAGE, "vipllava": _PER_IMAGE,
    "qwen2_vl": _QWEN_VL, "qwen2_5_vl": _QWEN_VL, "qwen3_vl": _QWEN_VL, "qwen3_vl_moe": _QWEN_VL,
}


def attribute(config, dotted: str):
    """config.a.b for 'a.b'."""
    for name in dotted.split("."):
        config = getattr(config, name)
    return config


def image_rows(config) -> Optional[RaggedRows]:
    """The ragged keys of batches for a model with this config (None: every input indexes samples)."""
    kinds = FAMILIES.get(getattr(config, "model_type", None))
    if not kinds:
        return None
    resolved = [(k, getattr(config, k.token, None), attribute(config, k.merge) if k.merge else 1) for k in kinds]

    def ragged(batch: Mapping[str, Any]) -> Dict[str, Callable[[int, int], Optional[torch.Tensor]]]:
        out: Dict[str, Callable[[int, int], Optional[torch.Tensor]]] = {}
        for kind, token, merge in resolved:
            keys = [k for k in (*kind.per_image, *kind.per_patch) if isinstance(batch.get(k), torch.Tensor)]
            if keys:
                out.update(_rows_of(batch, kind, token, merge, keys))
        return out

    return ragged


def _rows_of(batch: Mapping[str, Any], kind: ImageInputs, token: int, merge: int, keys) -> Dict[str, Callable]:
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or token is None:
        raise ValueError(f"{keys} index images, not samples: splitting them into microbatches needs `input_ids` "
                         f"with the image placeholder tokens ({kind.token}).")
    per_sample = (ids == token).sum(-1).reshape(-1).cpu()
    if kind.grid is not None:
        grid = batch[kind.grid].cpu()
        rows = grid.prod(-1)
        tokens = rows // merge ** 2
    else:
        images = batch[next(k for k in keys if k in kind.per_image)].shape[0]
        total = int(per_sample.sum())
        if images == 0 or total % images:
            raise ValueError(f"{total} image placeholder tokens ({kind.token}) do not make {images} images of equal "
                             f"size: {keys} cannot be split by sample.")
        tokens = torch.full((images,), total // images)
        rows = torch.ones(images, dtype=torch.long)
    image_ends = torch.cat([tokens.new_zeros(1), tokens.cumsum(0)])
    sample_ends = torch.cat([per_sample.new_zeros(1), per_sample.cumsum(0)])
    first = torch.searchsorted(image_ends, sample_ends)  # first image of each sample (and the end)
    if int(first[-1]) != len(tokens) or not torch.equal(image_ends[first.clamp(max=len(tokens))], sample_ends):
        raise ValueError(f"The image placeholder tokens ({kind.token}) of each sample, {per_sample.tolist()}, do not "
                         f"add up to whole images of {tokens.tolist()} tokens: {keys} cannot be split by sample.")
    row_ends = torch.cat([rows.new_zeros(1), rows.cumsum(0)])
    bounds = {k: (first, None) if k in kind.per_image else (first, row_ends) for k in keys}
    return {k: _slicer(batch[k], *bounds[k]) for k in keys}


def _slicer(value: torch.Tensor, first: torch.Tensor, row_ends: Optional[torch.Tensor]):
    def rows(start: int, end: int) -> Optional[torch.Tensor]:
        lo, hi = int(first[start]), int(first[end])
        if row_ends is not None:
            lo, hi = int(row_ends[lo]), int(row_ends[hi])
        return value[lo:hi] if hi > lo else None

    return rows


def take_samples(batch: Mapping[str, Any], start: int, end: int, ragged: Optional[RaggedRows] = None) -> MicroBatch:
    """Samples [start, end) of a batch: tensors indexing samples sliced along dim 0, ragged keys by their rows (left
    out where those samples have none), anything else as is."""
    special = ragged(batch) if ragged is not None else {}
    out: MicroBatch = {}
    for key, value in batch.items():
        if key in special:
            value = special[key](start, end)
            if value is None:
                continue
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            value = value[start:end]
        out[key] = value
    return out
