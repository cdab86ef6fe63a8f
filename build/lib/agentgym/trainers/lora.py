"""LoRA (``model.lora.rank > 0``): train low-rank adapters only, sync and export merged.

    agentgym train env=search model.lora.rank=16 model.lora.alpha=32

The policy is wrapped with peft's ``get_peft_model``; only the adapters have
``requires_grad`` (and optimizer state). The rollout engine holds the plain base
architecture, so every weight sync and every HF export carries *merged* weights,
``W + (alpha / r) B A`` per adapted layer (:func:`merge_state_dict`, computed from the
trainer's state dict without touching the trained model, so no merge/unmerge rounding
builds up). Checkpoints keep the adapters too (``adapter/``, peft format) so a run
resumes them exactly and peft users can load them on the base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """peft ``LoraConfig`` settings (``model.lora.*``)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str = "all-linear"
    seed: int = 0  # the adapters' random init: the same on every rank and every backend

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def wrap(model, spec: LoraSpec):
    """``model`` with LoRA adapters on ``spec.target_modules``; base weights frozen. The
    adapters' init draws from a generator seeded with ``spec.seed``, so every rank of a
    sharded backend (each builds its own copy before sharding) starts from the same."""
    from peft import LoraConfig, get_peft_model
    targets = spec.target_modules if spec.target_modules == "all-linear" else \
        [t.strip() for t in spec.target_modules.split(",") if t.strip()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return get_peft_model(model, LoraConfig(r=spec.rank, lora_alpha=spec.alpha,
                                                lora_dropout=spec.dropout,
                                                target_modules=targets, task_type="CAUSAL_LM"))


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def merge_state_dict(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A peft LoRA model's full state dict → the base model's, adapters merged in.

    ``…<layer>.base_layer.weight`` becomes ``…<layer>.weight + scaling * B @ A`` (computed
    in fp32, stored in the weight's dtype); adapter tensors are dropped; the peft prefix
    is removed, so the result loads into the plain architecture (the rollout engine,
    ``from_pretrained``).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".base_layer." in name:
            module, param = name.split(".base_layer.")
            if param == "weight":
                a = sd[f"{PEFT_PREFIX}{module}.lora_A.default.weight"].float()
                b = sd[f"{PEFT_PREFIX}{module}.lora_B.default.weight"].float()
                value = (value.float() + scaling * (b @ a)).to(value.dtype)
            name = f"{module}.{param}"
        out[name] = value
    return out


def scaling_of(model) -> float:
    cfg = model.peft_config["default"]
    return cfg.lora_alpha / (cfg.r ** 0.5 if cfg.use_rslora else cfg.r)


def save_adapter(model, path: str | Path) -> None:
    """The adapters alone, in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``)."""
    model.save_pretrained(Path(path))


def load_adapter(model, path: str | Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    f = Path(path) / "adapter_model.safetensors"
    if not f.exists():
        raise ValueError(f"{path} holds no LoRA adapter (adapter_model.safetensors); the "
                         f"checkpoint was written without model.lora.rank")
    result = set_peft_model_state_dict(model, load_file(str(f)))
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter in {path} does not match model.lora: unexpected "
                         f"{result.unexpected_keys[:5]}")


def save_adapter_from_state_dict(model, sd: dict[str, torch.Tensor], path: str | Path) -> None:
    """:func:`save_adapter` from a full state dict (sharded backends gather one on rank 0;
    their in-memory adapters are shards)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=sd)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"))
    model.peft_config["default"].save_pretrained(str(path))
