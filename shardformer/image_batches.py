"""Synthetic batches with images, laid out as each family's processor lays them out, read from the model's config:
- `image_batch`: a vision model's images (ViT, SAM, ...) and what its head takes (a class per image, masked patches,
  prompt points);
- `vlm_batch`: a vision-language model's text with images: a run of the image placeholder token per image, as many
  as the projector makes features (between begin/end-of-image tokens where the config has them), 0 to 2 images per
  sample, labels -100 on image tokens and padding. Pixel layouts: one row per image (LLaVA, Gemma 3, Mistral3: with
  `image_sizes` for Pixtral's encoder), Qwen-VL's flattened patches with an `image_grid_thw` row per image, or one
  row per sample padded with empty images (Idefics3 / SmolVLM).
Used by the proofs of inferred policies (proof/twin.py), the checker (hp_check) and the tests."""
from __future__ import annotations

import inspect
from typing import Dict, List, Tuple

import torch
from torch import nn

from .multimodal_batch import FAMILIES

__all__ = ["has_image_layout", "image_batch", "vlm_batch", "QWEN_GRIDS"]

QWEN_GRIDS = [(1, 4, 4), (1, 4, 8)]  # t, h, w patches of Qwen-VL's images, in turn
PER_SAMPLE = ("idefics3", "smolvlm")  # pixel_values (batch, images, C, H, W): images padded per sample
TEXT_TOKENS = 90                      # text token ids are drawn below this (and below every special token)


def image_batch(model: nn.Module, size: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    """Random images of the config's size and channels, and what the head takes: a class per image
    (`labels`, image classification), masked patches (`bool_masked_pos`, masked image modeling), prompt points
    (`input_points`, SAM: one prompt of two points per image, in pixels)."""
    config = model.config
    vision = getattr(config, "vision_config", config)  # (SAM: the images are its vision encoder's)
    side, patch = vision.image_size, getattr(vision, "patch_size", 1)
    side = side if isinstance(side, int) else side[0]
    batch = {"pixel_values": torch.randn(size, getattr(vision, "num_channels", 3), side, side, generator=g)}
    accepts = inspect.signature(model.forward).parameters
    if "labels" in accepts:
        batch["labels"] = torch.randint(0, max(2, getattr(config, "num_labels", 2) or 2), (size,), generator=g)
    if "bool_masked_pos" in accepts and type(model).__name__.endswith("MaskedImageModeling"):
        batch["bool_masked_pos"] = torch.rand(size, (side // patch) ** 2, generator=g) < 0.5
    if "input_points" in accepts:
        batch["input_points"] = torch.rand(size, 1, 2, 2, generator=g) * side
    return batch


def _first(config, *names):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


def _tokens_per_image(config) -> int:
    """Features the projector makes of one image: the config's count, else patches / merged patches."""
    given = _first(config, "mm_tokens_per_image", "num_query_tokens")  # (BLIP-2: one per query token)
    if given:
        return given
    vision = config.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2
    merge = _first(config, "scale_factor", "spatial_merge_size") or 1
    full = getattr(config, "vision_feature_select_strategy", None) == "full"  # (LLaVA: the CLS token too)
    return tokens // merge ** 2 + int(full)


def _images(config, count: int, g: torch.Generator) -> Tuple[List[torch.Tensor], List[int], List[tuple]]:
    """Pixel value rows, placeholder counts and grids of `count` images."""
    kind, vision = config.model_type, config.vision_config
    if any(k.grid for k in FAMILIES.get(kind, ())):  # Qwen-VL: a row per patch (C * T * P * P)
        grids = [QWEN_GRIDS[i % 2] for i in range(count)]
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        return [torch.randn(t * h * w, width, generator=g) for t, h, w in grids], \
            [t * h * w // merge ** 2 for t, h, w in grids], grids
    side, channels = vision.image_size, getattr(vision, "num_channels", 3)
    if kind in PER_SAMPLE:  # (1, 2, C, H, W) per sample, padded with all-zero images
        images = torch.zeros(1, 2, channels, side, side)
        images[0, :count] = torch.randn(count, channels, side, side, generator=g)
        return [images], [_tokens_per_image(config)] * count, []
    return [torch.randn(1, channels, side, side, generator=g) for _ in range(count)], \
        [_tokens_per_image(config)] * count, []


def has_image_layout(config) -> bool:
    """Whether `vlm_batch` knows how the family lays out its images (model_type) and the config names the image
    placeholder token."""
    known = config.model_type in FAMILIES or config.model_type in PER_SAMPLE
    return known and _first(config, "image_token_id", "image_token_index") is not None


def vlm_batch(model: nn.Module, batch_size: int, seed: int, seq: int = 24) -> Dict[str, torch.Tensor]:
    """Sample i holds i % 3 images (every pair of samples has one); sample 0 is padded on the right."""
    config = model.config
    kind = config.model_type
    if not has_image_layout(config):
        raise ValueError(f"No image batch layout for model_type {kind!r} (known: "
                         f"{sorted((*FAMILIES, *PER_SAMPLE))}, shardformer/image_batches.py), or its config names no "
                         f"image token (image_token_id / image_token_index).")
    image = _first(config, "image_token_id", "image_token_index")
    begin = _first(config, "boi_token_index", "vision_start_token_id")
    end = _first(config, "eoi_token_index", "vision_end_token_id")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TEXT_TOKENS, (batch_size, seq), generator=g)
    pixels: List[torch.Tensor] = []
    grids: List[tuple] = []
    for i in range(batch_size):
        rows, tokens, grid = _images(config, i % 3, g)
        pixels += rows
        grids += grid
        at = 1
        for n in tokens:
            run = ([begin] if begin is not None else []) + [image] * n + ([end] if end is not None else [])
            ids[i, at:at + len(run)] = torch.tensor(run)
            at += len(run) + 1
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    ids[0, -3:] = 0
    placeholders = ids == image
    batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat(pixels),
             "labels": ids.masked_fill(placeholders | (mask == 0), -100)}
    if grids:
        batch["image_grid_thw"] = torch.tensor(grids)
    accepts = inspect.signature(model.forward).parameters
    batch.update({k: placeholders.long() for k in ("token_type_ids", "mm_token_type_ids") if k in accepts})
    if config.vision_config.model_type == "pixtral":  # Pixtral's encoder reads each image's size
        side = config.vision_config.image_size
        batch["image_sizes"] = torch.tensor([[side, side]] * len(pixels))
    return batch
