"""LoRA (model.lora.rank): adapters only are trained; the engine sync and the HF export
are merged; the adapter loads with peft; resume is exact."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agentgym.config import build_config
from agentgym.data.rows import write_jsonl
from toy_envs import letter_rows
from agentgym.trainers.loop import train

LORA = {"model.lora.rank": 4, "model.lora.alpha": 8.0, "trainer.lr": 5e-2}


def _cfg(tmp_path, **over):
    data = tmp_path / "toy.jsonl"
    if not data.exists():
        write_jsonl(data, letter_rows(16))
    return build_config({"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
                         "trainer.total_steps": 2, "trainer.prompts_per_step": 2, "rollout.n": 4,
                         "rollout.max_tokens_per_turn": 8, "trainer.eval_limit": 0,
                         "trainer.save_every": 1, "run_dir": str(tmp_path / "run"),
                         **LORA, **over})


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_lora_trains_adapters_and_exports_merged_weights(tmp_path, tiny_path):
    from peft import PeftModel
    run = train(_cfg(tmp_path))
    ckpt = run / "checkpoints" / "step_2"
    init, merged = load_file(str(tiny_path / "model.safetensors")), load_file(
        str(ckpt / "model.safetensors"))
    assert merged.keys() == init.keys()  # the plain architecture: from_pretrained works
    adapted = [k for k in init if k.endswith("proj.weight")]
    assert adapted and all(not torch.equal(merged[k], init[k]) for k in adapted)
    frozen = [k for k in init if k not in adapted]  # embeddings, norms, biases
    assert frozen and all(torch.equal(merged[k], init[k]) for k in frozen)
    # peft's adapter on the base model = the merged export
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    exported = AutoModelForCausalLM.from_pretrained(ckpt)
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path),
                                             ckpt / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits,
                                   with_adapter(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # the engine sampled step 2 with the merged step-1 weights: trainer and engine agree
    rows = _metrics(run)
    assert rows[1]["rollout/policy_version"] == 1.0 and rows[1]["rollout/drift_max"] < 1e-3


def test_lora_resume_matches_an_uninterrupted_run(tmp_path):
    straight = train(_cfg(tmp_path, **{"trainer.total_steps": 3, "run_dir": str(tmp_path / "a")}))
    b = tmp_path / "b"
    train(_cfg(tmp_path, **{"trainer.total_steps": 1, "run_dir": str(b)}))
    train(_cfg(tmp_path, **{"trainer.total_steps": 3, "run_dir": str(b)}))
    drop = ("time/", "rollout/generate_s", "rollout/env_s", "rollout/drift_")  # see test_kill_resume
    clean = lambda rows: [{k: v for k, v in r.items() if not k.startswith(drop)}  # noqa: E731
                          for r in rows]
    assert clean(_metrics(b)) == clean(_metrics(straight))
    wa = load_file(str(straight / "checkpoints" / "step_3" / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(b / "checkpoints" / "step_3" / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
