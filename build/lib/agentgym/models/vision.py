"""Images through the stack for Qwen2.5-VL-style models (``model=tiny-vl``, or a local
Qwen2-VL / Qwen2.5-VL folder).

- The chat template renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>``;
  :func:`expand_image_tokens` repeats ``<|image_pad|>`` to the image's token count
  (``grid_t * grid_h * grid_w / merge_size**2``), the step ``Qwen2_5_VLProcessor`` does
  (which needs torchvision, unusable on CPU here: ../shared/PLATFORM.md).
- The image processor (``Qwen2VLImageProcessorPil``: PIL and numpy) turns images into
  ``pixel_values`` (patches x features) and ``image_grid_thw`` (images x 3):
  :class:`VisionInputs`, carried by the trajectory, given to the engine every turn and
  to the trainer's forward pass.
- Positions: Qwen2.5-VL uses 3-D rotary positions (M-RoPE). :func:`mrope_positions`
  computes them with the model's own ``get_rope_index`` for a padded batch; the engine and
  the trainer both pass them explicitly, so the two forward passes see the same
  positions. After the prompt every position is text, and the three components are equal.

Image placeholder tokens belong to the prompt, so their loss mask is 0 like any prompt
token. The policy never samples a vision special token (``<|image_pad|>``,
``<|vision_start|>``...): a sampled placeholder would be taken for an image slot by the
next forward pass. Engine and trainer both remove them from the distribution
(:func:`suppress_vision_tokens`), so their logprobs stay the same quantity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGE_PAD = "<|image_pad|>"


@dataclass
class VisionInputs:
    """Processed images of one sequence, in the order their placeholders appear."""

    pixel_values: torch.Tensor  # (patches, features)
    image_grid_thw: torch.Tensor  # (images, 3), long

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])


def is_vl_model(model) -> bool:
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


#: what the suppressed tokens' logits become (finite, so 0 * logit stays 0 in entropies)
_SUPPRESSED = -1e9


def vision_token_ids(model) -> list[int]:
    """The vision special tokens of a VL model's vocabulary."""
    c = model.config
    return sorted({int(i) for i in (getattr(c, k, None) for k in (
        "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"))
        if i is not None})


def suppress_vision_tokens(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """``logits`` (..., V) with the vision special tokens made impossible (in place)."""
    if token_ids:
        logits[..., token_ids] = _SUPPRESSED
    return logits


def load_image_processor(path: str | Path):
    """The image processor saved with a model folder, or None for a text-only model."""
    path = Path(path)
    if not (path / "preprocessor_config.json").exists():
        return None
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if "vision_config" not in cfg:
        return None
    from transformers import AutoImageProcessor
    try:
        return AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    except ImportError:  # transformers 5.17 (the GPU image's) asks torchvision of the auto
        # class even where a PIL one exists; later versions fall back to it themselves
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        return Qwen2VLImageProcessorPil.from_pretrained(str(path), local_files_only=True)


def encode_images(processor, images: list[Any]) -> VisionInputs:
    """PIL images → :class:`VisionInputs` (the processor's resize, patching and merge)."""
    out = processor(images=images, return_tensors="pt")
    return VisionInputs(out["pixel_values"].float(), out["image_grid_thw"].long())


def image_token_counts(vision: VisionInputs, merge_size: int) -> list[int]:
    return [int(n) for n in (vision.image_grid_thw.prod(-1) // merge_size ** 2).tolist()]


def expand_image_tokens(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Each single ``image_token_id`` in ``ids`` repeated to its image's token count."""
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ValueError(f"the prompt has {found} image placeholders for {len(counts)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    return out


def merge_vision(rows: list[VisionInputs | None], device=None) -> dict[str, torch.Tensor]:
    """Model kwargs for a batch whose rows carry these images (row order); {} if none."""
    present = [v for v in rows if v is not None and v.num_images]
    if not present:
        return {}
    return {"pixel_values": torch.cat([v.pixel_values for v in present]).to(device),
            "image_grid_thw": torch.cat([v.image_grid_thw for v in present]).to(device)}


def mrope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """3-D positions ``(3, B, L)`` of a padded batch (padding positions 0)."""
    inner = model.model if hasattr(model.model, "get_rope_index") else model
    image_token_id = model.config.image_token_id
    types = (input_ids == image_token_id).int()
    if image_grid_thw is None or not types.any():
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return pos[None].expand(3, -1, -1).contiguous()
    positions, _ = inner.get_rope_index(input_ids, mm_token_type_ids=types,
                                        image_grid_thw=image_grid_thw,
                                        attention_mask=attention_mask)
    return positions


def vl_forward_kwargs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      rows: list[VisionInputs | None] | None) -> dict[str, Any]:
    """``pixel_values``, ``image_grid_thw`` and explicit 3-D ``position_ids`` for one
    forward pass of a VL model over a padded batch; {} for text-only models."""
    if not is_vl_model(model):
        if rows and any(v is not None for v in rows):
            raise ValueError("images were given to a text-only model; use a vision-language "
                             "model (model=tiny-vl or a Qwen2.5-VL folder)")
        return {}
    kw = merge_vision(rows or [], input_ids.device)
    kw["position_ids"] = mrope_positions(model, input_ids, attention_mask,
                                         kw.get("image_grid_thw"))
    return kw
