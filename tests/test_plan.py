"""The memory planner (``agentgym plan``): per-device memory from a shape and the run's
settings, calibrated on the CPU against measured peaks, and the cheapest change that fits."""

from __future__ import annotations

import dataclasses
import json

from agentgym.cli import main
from agentgym.models.plan import (GiB, Setting, breakdown, cheapest_fit, count_parameters,
                                  parse_bytes, shape_numbers, total)
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
    # the cheapest that suffices: at 60 GiB, half the micro-batch (priced 0.5) rather than
    # checkpointing or half the episodes in flight (1 each), though each of them would fit
    roomy = dataclasses.replace(s, backend="fsdp", gpus=8, offload=True)
    assert total(shape, roomy) > 60 * GiB
    for other in ({"checkpointing": True}, {"concurrency": 32}):
        assert total(shape, dataclasses.replace(roomy, **other)) <= 60 * GiB
    changes, fitted = cheapest_fit(shape, roomy, 60 * GiB)
    assert changes == ["trainer.micro_batch_tokens=2048"] and total(shape, fitted) <= 60 * GiB
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
