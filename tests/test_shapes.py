"""Model shapes (agentgym/models/configs): the published configs, no weights, and random
models of each family shrunk to test size (``model=tiny:SHAPE``)."""

from __future__ import annotations

import json

import pytest
import torch

from agentgym.models.shapes import build_shrunk, is_vision, shape_config, shape_names, shrunk_config
from agentgym.models.zoo import resolve_model

TEXT = [n for n in shape_names() if not is_vision(shape_config(n))]


def test_the_shipped_shapes_are_published_configs():
    assert "smollm2-135m" in shape_names()
    for name in shape_names():
        c = shape_config(name)
        text = c.get("text_config", c)  # a vision-language config nests its language model
        assert c["architectures"] and c["model_type"]
        assert all(k in c or k in text for k in ("hidden_size", "num_hidden_layers",
                                                 "num_attention_heads", "vocab_size"))


@pytest.mark.parametrize("name", TEXT)
def test_a_shrunk_shape_keeps_its_family_and_runs(tmp_path, name):
    published = shape_config(name)
    small = shrunk_config(name, 1024)
    assert small["model_type"] == published["model_type"]
    assert small["architectures"] == published["architectures"]
    assert small["tie_word_embeddings"] == published.get("tie_word_embeddings", False)
    assert small["hidden_act"] == published["hidden_act"]
    heads, kv = published["num_attention_heads"], published.get("num_key_value_heads", 0)
    grouped = bool(kv) and kv < heads
    assert (small["num_key_value_heads"] < small["num_attention_heads"]) == grouped
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(build_shrunk(name, tmp_path / name))
    assert type(model).__name__ == published["architectures"][0]
    assert model.num_parameters() < 1e6
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


def test_a_vision_language_shape_shrinks_to_tiny_vl(tmp_path):
    with pytest.raises(ValueError, match="its shrunk model is tiny-vl"):
        shrunk_config("qwen2.5-vl-7b", 1024)
    folder = build_shrunk("qwen2.5-vl-7b", tmp_path / "vl")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == shape_config("qwen2.5-vl-7b")["model_type"] == "qwen2_5_vl"


def test_tiny_shape_names_resolve_through_the_zoo(tmp_path):
    folder = resolve_model("tiny:smollm2-135m", cache_dir=tmp_path)
    assert folder.name == "tiny-smollm2-135m"
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert resolve_model("tiny:smollm2-135m", cache_dir=tmp_path) == folder  # cached
    with pytest.raises(ValueError, match=r"unknown model shape 'qwen9'.*; valid: qwen2\.5-0\.5b"):
        resolve_model("tiny:qwen9", cache_dir=tmp_path)
    weightless = [n for n in shape_names() if n != "smollm2-135m"]  # the zoo builds that one
    for name in weightless[:1]:
        with pytest.raises(ValueError, match=f"is a shape .* model=tiny:{name}"):
            resolve_model(name, cache_dir=tmp_path)
