"""The memory planner (``agentgym plan``): per-device memory from a shape and the run's
settings, calibrated on the CPU against measured peaks, and the cheapest change that fits."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agentgym.cli import main
from agentgym.models.plan import (AUTO_GPU_TOKENS, AUTO_HOST_TOKENS, GiB, Setting,
                                  auto_tokens, breakdown, cheapest_fit, count_parameters,
                                  micro_batch_tokens, parse_bytes, setting_of, shape_numbers,
                                  total)
from agentgym.models.shapes import shape_config
from agentgym.models.zoo import resolve_model

#: peak RSS (GiB) of one update, bench/update_memory.py (docs/BENCHMARKS.md, "Update memory")
MEASURED = {(1024, 0, False): 3.96, (1024, 1024, False): 3.96, (1024, 1024, True): 2.96,
            (4096, 0, False): 9.40, (4096, 1024, False): 6.68, (4096, 1024, True): 3.27,
            (8192, 0, False): 16.65, (8192, 1024, False): 10.20, (8192, 1024, True): 3.57}


#: the packed update's cells (trainer.packing, issue 56): (tokens, checkpointing) -> GiB
MEASURED_PACKED = {(1024, False): 3.53, (1024, True): 2.58, (4096, False): 7.01,
                   (4096, True): 3.48, (8192, False): 11.40, (8192, True): 4.52}


def test_cpu_plans_of_the_packed_update_are_within_15_percent_of_the_measured_peaks():
    shape = shape_numbers(shape_config("smollm2-135m"))
    for (tokens, ckpt), measured in MEASURED_PACKED.items():
        s = Setting(device="host", micro_batch_tokens=tokens, logprob_chunk=1024,
                    checkpointing=ckpt, packing=True, engine=False)
        planned = total(shape, s) / GiB
        assert abs(planned - measured) / measured < 0.15, (tokens, ckpt, planned)


def test_the_planner_counts_what_the_fused_head_keeps():
    from agentgym.trainers import fused_head
    from agentgym.models.plan import HEAD_KEEP_BYTES
    assert fused_head.KEEP_BYTES == HEAD_KEEP_BYTES


def test_cpu_plans_are_within_15_percent_of_the_measured_peaks():
    shape = shape_numbers(shape_config("smollm2-135m"))
    for (tokens, chunk, ckpt), measured in MEASURED.items():
        s = Setting(device="host", micro_batch_tokens=tokens, logprob_chunk=chunk,
                    checkpointing=ckpt, packing=False, engine=False)  # padded rows
        planned = total(shape, s) / GiB
        assert abs(planned - measured) / measured < 0.15, (tokens, chunk, ckpt, planned)


def test_parameters_are_counted_exactly():
    built = resolve_model("tiny:qwen2.5-3b")  # the same family: count it both ways
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(built)
    config = json.loads((built / "config.json").read_text())
    assert count_parameters(config) == model.num_parameters()
    # the published sizes (Qwen2.5-3B: 3.09B, 7B: 7.62B; SmolLM2-135M: 134.5M)
    assert round(shape_numbers(shape_config("qwen2.5-3b")).params / 1e9, 2) == 3.09
    assert round(shape_numbers(shape_config("qwen2.5-7b")).params / 1e9, 2) == 7.62
    assert round(shape_numbers(shape_config("smollm2-135m")).params / 1e6, 1) == 134.5


def test_sharding_divides_what_each_backend_shards():
    shape = shape_numbers(shape_config("qwen2.5-7b"))
    one = dict(breakdown(shape, Setting(engine=False)))
    fsdp = dict(breakdown(shape, Setting(engine=False, backend="fsdp", gpus=8)))
    z1 = dict(breakdown(shape, Setting(engine=False, backend="deepspeed", zero_stage=1, gpus=8)))
    z2 = dict(breakdown(shape, Setting(engine=False, backend="deepspeed", zero_stage=2, gpus=8)))
    w, g, o = "policy weights (fp32)", "gradients (fp32)", "AdamW state (2 x fp32)"
    assert one[w] == 4 * shape.params and one[o] == 8 * shape.params
    assert fsdp[w] == one[w] / 8 and fsdp[g] == one[g] / 8 and fsdp[o] == one[o] / 8
    assert z1[w] == one[w] and z1[g] == one[g] and z1[o] == one[o] / 8
    assert z2[w] == one[w] and z2[g] == one[g] / 8 and z2[o] == one[o] / 8
    lora = dict(breakdown(shape, Setting(engine=False, lora_rank=16)))
    assert lora[o] < one[o] / 100  # only the adapters train


def test_the_cheapest_change_that_fits():
    shape = shape_numbers(shape_config("qwen2.5-7b"))
    s = Setting(concurrency=64, episode_tokens=6144, reference=True)
    assert total(shape, s) > 80 * GiB
    changes, fitted = cheapest_fit(shape, s, 80 * GiB)
    assert total(shape, fitted) <= 80 * GiB and changes
    assert "trainer.backend=fsdp" in changes and "trainer.offload=true" in changes
    # the cheapest that suffices: at 66 GiB, half the micro-batch (priced 0.5) rather than
    # checkpointing or half the episodes in flight (1 each), though each of them would fit
    roomy = dataclasses.replace(s, backend="fsdp", gpus=8, offload=True)
    assert total(shape, roomy) > 66 * GiB
    for other in ({"checkpointing": True}, {"concurrency": 32}):
        assert total(shape, dataclasses.replace(roomy, **other)) <= 66 * GiB
    changes, fitted = cheapest_fit(shape, roomy, 66 * GiB)
    assert changes == ["trainer.micro_batch_tokens=2048"] and total(shape, fitted) <= 66 * GiB
    assert cheapest_fit(shape, s, 1 * GiB) is None


def test_plan_prints_a_verdict_for_a_recipe(capsys):
    assert main(["plan", "recipe=search_r1_qwen2.5_3b_grpo", "gpus=8", "gpu_memory=80GB"]) == 0
    out = capsys.readouterr().out
    assert "3.09B parameters" in out and "verdict: fits" in out
    assert main(["plan", "recipe=retool_qwen2.5_7b", "gpus=8", "gpu_memory=80GB"]) == 0
    assert "cheapest change that fits: rollout.max_concurrency=32" in capsys.readouterr().out
    assert main(["plan", "model=qwen2.5-7b", "gpu_memory=lots"]) == 2
    assert "gpu_memory='lots': expected a size such as 80GB" in capsys.readouterr().err
    assert parse_bytes("80GB") == parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("512MB") == 512 * 2 ** 20


def test_plan_counts_a_critic_exactly_when_the_estimator_reads_values(capsys):
    """``agentgym plan`` asks the config whether the run trains a critic
    (``AlgoConfig.needs_critic``, as the trainer does): PPO's ``gae`` and the turn-level
    ``gae_turn`` do, GRPO does not."""
    rows = ("critic: weights, gradients, AdamW", "critic: activations")
    for algo, critic in ((["algo=ppo"], True), (["algo=ppo", "algo.advantage=gae_turn"], True),
                         (["algo=grpo"], False)):
        assert main(["plan", "model=qwen2.5-3b", *algo, "gpus=8", "gpu_memory=80GB"]) == 0
        out = capsys.readouterr().out
        assert all((row in out) == critic for row in rows), (algo, out)


def test_plan_on_the_cpu_counts_the_engine_in_its_dtype_and_its_packed_copy(capsys):
    """On the CPU the rollout engine holds the model's dtype (fp32 by default) and, with
    ``engine.packed_weights``, a packed copy of its linears; on a GPU its bf16 weights."""
    args = ["plan", "model=smollm2-135m", "gpus=1", "gpu_memory=24GB"]
    packed = "rollout engine packed linears (fp32, engine.packed_weights)"
    assert main([*args, "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine weights (fp32)" in out and packed in out
    assert main([*args, "trainer.device=cpu", "engine.packed_weights=false"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine weights (fp32)" in out and "packed" not in out
    assert main([*args, "trainer.device=cuda"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine weights (bf16)" in out and "packed" not in out
    shape = shape_numbers(shape_config("smollm2-135m"))
    rows = dict(breakdown(shape, Setting(device="host", engine_dtype="float32",
                                         engine_packed=True)))
    assert rows[packed] == rows["rollout engine weights (fp32)"] == 4 * shape.params


#: an H200's update, bench/update_speed.py --bf16 on random-initialised shapes (docs/GPU.md):
#: (shape, the largest packed micro-batch in tokens) -> the step's allocated peak above its
#: start, GiB (weights, gradients and AdamW were allocated before: 16 bytes a parameter)
MEASURED_GPU = {("qwen2.5-1.5b", 3581): 19.25, ("qwen2.5-1.5b", 10490): 37.38,
                ("qwen2.5-1.5b", 3864): 17.53, ("qwen2.5-1.5b", 14034): 52.07,
                ("smollm2-135m", 3581): 4.94, ("smollm2-135m", 10490): 12.44,
                ("smollm2-135m", 3864): 4.28, ("smollm2-135m", 14034): 14.07,
                ("smollm2-135m", 37424): 35.67}


def test_the_gpu_plan_is_never_short_of_a_measured_h200_update():
    """What the planner decides fits must fit: against every measured GPU cell its total is
    at most 10% short of what torch allocated, and (the CUDA context it adds aside) within
    15% either way; over the cells within 10% on average."""
    errors = []
    for (name, tokens), step in MEASURED_GPU.items():
        shape = shape_numbers(shape_config(name))
        planned = total(shape, Setting(micro_batch_tokens=tokens, engine=False))
        measured = 16 * shape.params + step * GiB
        assert planned >= 0.9 * measured, (name, tokens, planned / GiB, measured / GiB)
        no_context = (planned - dict(breakdown(shape, Setting()))["process (runtime, libraries)"])
        errors.append(abs(no_context - measured) / measured)
        assert errors[-1] <= 0.15, (name, tokens, no_context / GiB, measured / GiB)
    assert sum(errors) / len(errors) <= 0.10, errors


def test_micro_batch_tokens_auto_is_the_cpus_budget_or_the_largest_the_gpu_plan_fits():
    from agentgym.config import build_config
    cfg = build_config({"model": "qwen2.5-1.5b", "algo": "grpo"})
    assert cfg.trainer.micro_batch_tokens == 0  # the default: auto
    assert micro_batch_tokens(cfg) == AUTO_HOST_TOKENS  # this machine has no GPU
    assert micro_batch_tokens(build_config({"trainer.micro_batch_tokens": 777})) == 777
    shape = shape_numbers(shape_config("qwen2.5-1.5b"))
    gpu = setting_of(cfg, 1, "gpu")
    assert auto_tokens(shape, dataclasses.replace(gpu, device="host"), 140 * GiB) == 4096
    picked = {cap: auto_tokens(shape, gpu, cap * GiB) for cap in (24, 80, 140)}
    assert picked == {24: 4096, 80: 8192, 140: 16384}, picked
    for cap, tokens in picked.items():  # the largest candidate that fits 80% of the device
        fits = lambda t: total(shape, dataclasses.replace(gpu, micro_batch_tokens=t)) \
            <= 0.8 * cap * GiB  # noqa: E731
        assert tokens == AUTO_GPU_TOKENS[-1] or fits(tokens)
        assert not any(fits(t) for t in AUTO_GPU_TOKENS if t > tokens)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1, or 0 for auto; got -1"):
        build_config({"trainer.micro_batch_tokens": -1})


def test_plan_says_when_the_micro_batch_is_auto(capsys):
    assert main(["plan", "model=qwen2.5-1.5b", "gpu_memory=140GB"]) == 0
    assert "micro-batch 16384 tokens (auto)" in capsys.readouterr().out
    assert main(["plan", "model=qwen2.5-1.5b", "gpu_memory=80GB",
                 "trainer.micro_batch_tokens=4096"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 4096 tokens," in out and "(auto)" not in out
