"""Model shapes: the published ``config.json`` of the architectures the recipes and the GPU
check name (``agentgym/models/configs/NAME.json``: smollm2, Qwen2.5, Qwen2.5-VL), with no
weights, and models of a shape's family shrunk to test size.

    shape_names()                     # ['qwen2.5-3b', 'smollm2-135m', ...]
    shape_config("qwen2.5-7b")        # the published config, a dict
    build_shrunk("qwen2.5-3b", out)   # a random Qwen2 of hidden 64, 2 layers, tiny's tokenizer

``model=tiny:qwen2.5-3b`` (:mod:`agentgym.models.zoo`) builds and caches the shrunk model:
the recipes' tests run a step of each recipe on the CPU that way. A shape name alone is
not a model (there are no weights here): training one needs its weights' folder.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from agentgym.core.registry import did_you_mean
from agentgym.models.tiny import (CHATML_TEMPLATE, EOS_TOKEN, PAD_TOKEN, _tiny_tokenizer,
                                  build_tiny_vl)

CONFIGS = Path(__file__).resolve().parent / "configs"
#: shrunk dimensions: tiny's (agentgym.models.tiny) in each family
SHRUNK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4}
#: keys of a published config that describe a file, not the architecture
_DROP = ("_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype")


def shape_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def shape_config(name: str) -> dict[str, Any]:
    """The published ``config.json`` of shape ``name``."""
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        names = shape_names()
        raise ValueError(f"unknown model shape {name!r}{did_you_mean(name, names)}; valid: "
                         f"{', '.join(names)}")
    return json.loads(path.read_text(encoding="utf-8"))


def shape_digest(name: str) -> str:
    return hashlib.sha256((CONFIGS / f"{name}.json").read_bytes()).hexdigest()[:16]


def is_vision(config: dict[str, Any]) -> bool:
    return "vision_config" in config


def shrunk_config(name: str, vocab_size: int, **token_ids: int | None) -> dict[str, Any]:
    """Shape ``name``'s config with tiny dimensions (:data:`SHRUNK`) and ``vocab_size``:
    the same ``model_type``, architecture, activation, normalisation, RoPE, biases and tied
    embeddings; key/value heads keep the published grouping as far as 4 heads allow (MHA
    stays MHA, grouped attention keeps fewer key/value heads than query heads)."""
    config = {k: v for k, v in shape_config(name).items() if k not in _DROP}
    if is_vision(config):
        raise ValueError(f"{name} is a vision-language shape: its shrunk model is tiny-vl")
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or \
        config["num_attention_heads"]
    small_kv = SHRUNK["num_attention_heads"] if kv == heads else \
        max(1, SHRUNK["num_attention_heads"] // math.ceil(heads / kv))
    config.update(SHRUNK, num_key_value_heads=small_kv, vocab_size=vocab_size,
                  head_dim=SHRUNK["hidden_size"] // SHRUNK["num_attention_heads"],
                  max_position_embeddings=min(config.get("max_position_embeddings", 4096), 4096),
                  dtype="float32", **token_ids)
    config.pop("max_window_layers", None)  # Qwen2's sliding-window layer count: of the full depth
    config.pop("layer_types", None)
    return config


def build_shrunk(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random model of shape ``name``'s family at tiny dimensions, with ``tiny``'s
    tokenizer (a vision-language shape: ``tiny-vl``'s build). Same arguments give
    byte-identical files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if is_vision(shape_config(name)):
        return build_tiny_vl(out_dir, seed=seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, _, _ = _tiny_tokenizer(1024, (), CHATML_TEMPLATE)
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    values = shrunk_config(name, 64 * math.ceil(len(tokenizer) / 64), eos_token_id=eos_id,
                           pad_token_id=pad_id, bos_token_id=None)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
