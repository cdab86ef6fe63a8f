"""Images through the stack with ``tiny-vl`` (random Qwen2.5-VL): the image reaches the
model, engine logprobs equal the trainer's forward pass with the images, placeholders are
masked 0, and ``agentgym rollout`` / ``agentgym train`` run on the geometry env."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.engines.hf import HFEngine
from agentgym.core.types import SamplingParams
from agentgym.models.vision import IMAGE_PAD, VisionInputs, vision_token_ids
from agentgym.envs.geometry import BUILTIN_ROWS, load_image
from agentgym.trainers.backends.base import sequence_logprobs


@pytest.fixture(scope="module")
def vl():
    from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
    path = resolve_model("tiny-vl")
    return load_model(path).eval(), load_tokenizer(path)


def _prompt(tok, image, text="Find x."):
    chat = ChatTokens(tok)
    content = [{"type": "image", "image": image}] if image is not None else []
    return chat.prompt([{"role": "user", "content": content + [{"type": "text", "text": text}]}])


def _images():
    return [load_image(r["images"][0]) for r in BUILTIN_ROWS]


def test_the_prompt_carries_expanded_placeholders(vl):
    model, tok = vl
    ids, vision = _prompt(tok, _images()[0])
    assert isinstance(vision, VisionInputs) and vision.num_images == 1
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    t, h, w = vision.image_grid_thw[0].tolist()
    assert ids.count(pad) == t * h * w // 4  # merge 2x2
    text_ids, none = _prompt(tok, None)
    assert none is None and pad not in text_ids


def test_the_image_reaches_the_model(vl):
    model, tok = vl
    a, b = _images()
    (ids_a, va), (ids_b, vb) = _prompt(tok, a), _prompt(tok, b.resize(a.size))
    assert ids_a == ids_b  # same size: same tokens, only the pixels differ
    x = torch.tensor([ids_a])
    mask = torch.ones_like(x)
    la, _ = sequence_logprobs(model, x, mask, images=[va])
    lb, _ = sequence_logprobs(model, x, mask, images=[vb])
    after = ids_a.index(tok.convert_tokens_to_ids("<|vision_end|>")) + 1
    assert (la[0, after:] - lb[0, after:]).abs().max() > 1e-4  # the text after it sees the pixels
    engine = HFEngine(model, tok)
    try:
        async def both():
            greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
            return await asyncio.gather(engine.generate(ids_a, greedy, images=va),
                                        engine.generate(ids_a, greedy, images=vb))
        oa, ob = asyncio.run(both())
    finally:
        engine.close()
    assert oa.logprobs != ob.logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_trainer_forward_with_images(vl, temperature):
    model, tok = vl
    a, b = _images()
    prompts = [_prompt(tok, a), _prompt(tok, b, "Find m \\angle B."), _prompt(tok, None),
               _prompt(tok, a, "Another question about this figure?")]
    engine = HFEngine(model, tok, batch_wait_s=0.05)
    try:
        async def all_rows():  # one batch, mixed image sizes and a text-only row
            return await asyncio.gather(*(engine.generate(
                ids, SamplingParams(max_new_tokens=12, temperature=temperature, seed=i),
                images=v) for i, (ids, v) in enumerate(prompts)))
        outs = asyncio.run(all_rows())
    finally:
        engine.close()
    never = set(vision_token_ids(model))
    for (ids, v), out in zip(prompts, outs):
        assert not never & set(out.ids)  # placeholders are never sampled
        seq = torch.tensor([ids + out.ids])
        ref, _ = sequence_logprobs(model, seq, torch.ones_like(seq), temperature,
                                   images=[v], start=len(ids))
        assert out.logprobs == pytest.approx(ref[0, len(ids):].tolist(), abs=1e-4)


def test_rollout_masks_placeholders_and_trains_on_geometry(tmp_path, capsys):
    from agentgym.cli import main
    out = tmp_path / "traj.jsonl"
    assert main(["rollout", "env=geometry", "model=tiny-vl", "n=2", "limit=2",
                 "rollout.max_tokens_per_turn=12", f"out={out}"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    from agentgym.models.zoo import load_tokenizer, resolve_model
    pad = load_tokenizer(resolve_model("tiny-vl")).convert_tokens_to_ids(IMAGE_PAD)
    for r in rows:
        (t, h, w), = r["image_grid_thw"]
        at = [i for i, tok in enumerate(r["token_ids"]) if tok == pad]
        assert len(at) == t * h * w // 4 and max(at) < r["prompt_length"]
        assert all(r["loss_mask"][i] == 0 for i in at)
    run = tmp_path / "run"
    # an entropy bonus keeps the update running: with the untrained model's all-zero
    # rewards it would be skipped, and with it the drift measurement this test checks
    assert main(["train", "env=geometry", "model=tiny-vl", "trainer.total_steps=2",
                 "trainer.prompts_per_step=2", "n=2", "rollout.max_tokens_per_turn=12",
                 "trainer.eval_limit=2", "algo.entropy_coef=0.001", f"run_dir={run}"]) == 0
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
             if "rollout/reward" in x]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["rollout/drift_max"] < 1e-3 for s in steps)  # engine == trainer, with images
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "preprocessor_config.json").exists()  # the checkpoint serves images too
    from agentgym.models.vision import load_image_processor
    assert load_image_processor(ckpt) is not None


def test_unsupported_vl_settings_fail_before_loading(tmp_path):
    from agentgym.config import build_config
    from agentgym.trainers.loop import train
    for key, value, needle in (("trainer.backend", "fsdp", "trainer.backend=fsdp"),
                               ("algo", "ppo", "a critic"), ("model.lora.rank", 4, "lora")):
        cfg = build_config({"env": "geometry", "model": "tiny-vl", "rollout.n": 2, key: value,
                            "run_dir": str(tmp_path / key)})
        with pytest.raises(ValueError, match=needle):
            train(cfg)


def test_sft_refuses_a_vision_language_model_up_front(tmp_path):
    from agentgym.config import build_config
    from agentgym.trainers.sft import sft
    run = tmp_path / "sft"
    cfg = build_config({"env": "geometry", "model": "tiny-vl", "run_dir": str(run)})
    with pytest.raises(ValueError, match=r"agentgym sft with a vision-language model "
                                         r"\(model=tiny-vl\) is not supported"):
        sft(cfg)
    assert not run.exists()  # refused before anything was written
