"""On a CUDA GPU (``make gpu-check`` runs these; skipped elsewhere): the engine on the
device agrees with the trainer's logprobs and takes weight updates (the whole engine
conformance suite), the single backend steps there, FSDP2 on one rank over NCCL agrees with
it, and a 20-step GRPO run of smollm2-135m on the search env goes through on the GPU."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cuda_tiny(tiny_path):
    from agentgym.models.zoo import load_model
    model = load_model(tiny_path, device="auto")
    assert next(model.parameters()).is_cuda
    return model


# --- the engine on the GPU: logprobs equal a forward pass, weight updates visible ---------

from engine_conformance import EngineCase, EngineConformance  # noqa: E402


@pytest.fixture(scope="module")
def case(cuda_tiny, tiny_tokenizer):
    import functools

    from agentgym.rollout.engines.base import push_weights
    from agentgym.rollout.engines.hf import HFEngine
    engine = HFEngine(copy.deepcopy(cuda_tiny), tiny_tokenizer, batch_wait_s=0.02)
    # GPU kernels pick their blocking by batch shape: fp32 agreement to 1e-3, not 1e-4
    yield EngineCase(engine, tiny_tokenizer, copy.deepcopy(cuda_tiny),
                     functools.partial(push_weights, engine), atol=1e-3)
    engine.close()


class TestEngineConformanceOnCUDA(EngineConformance):
    pass


# --- training on the GPU: the single backend, and FSDP2 on one NCCL rank agreeing with it --

@pytest.fixture(scope="module")
def single_on_cuda(tiny_path, tiny_tokenizer):
    from agentgym.config import build_config
    from test_backends import _batches, _run
    from agentgym.trainers.backends.base import ModelSpec
    from agentgym.trainers.backends.single import SingleBackend
    batches = _batches(tiny_tokenizer)
    backend = SingleBackend(ModelSpec(str(tiny_path)).load(), lr=1e-2, micro_batch_tokens=64,
                            logprob_chunk=16)
    assert backend.device.type == "cuda"
    return batches, _run(backend, batches, build_config({}))


def test_single_backend_steps_on_cuda(single_on_cuda, tiny_path):
    from agentgym.trainers.backends.base import ModelSpec
    _, (losses, metrics, lp, _, weights) = single_on_cuda
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(m["grad_norm"] > 0 for m in metrics)
    init = ModelSpec(str(tiny_path), device="cpu").load().state_dict()
    assert max(float((weights[k].cpu() - init[k]).abs().max()) for k in weights) > 1e-3


def test_fsdp2_on_one_nccl_rank_matches_single(single_on_cuda, tiny_path):
    from agentgym.config import build_config
    from test_backends import LPTOL, RTOL, WATOL, _run
    from agentgym.trainers.backends.base import ModelSpec
    from agentgym.trainers.backends.distributed import DistributedBackend
    from agentgym.trainers.backends.ranks import OptimSpec
    batches, (losses, _, lp, _, weights) = single_on_cuda
    backend = DistributedBackend("fsdp", ModelSpec(str(tiny_path)), OptimSpec(lr=1e-2), 1, 64)
    try:
        d_losses, _, d_lp, _, d_weights = _run(backend, batches, build_config({}))
    finally:
        backend.close()
    assert d_losses == pytest.approx(losses, rel=100 * RTOL)
    torch.testing.assert_close(d_lp.cpu(), lp.cpu(), atol=10 * LPTOL, rtol=0)
    for k in weights:
        torch.testing.assert_close(d_weights[k].cpu(), weights[k].cpu(), atol=10 * WATOL, rtol=0)


# --- the main job on the GPU --------------------------------------------------------------

def test_grpo_20_steps_smollm2_arith_on_cuda(tmp_path):
    """``agentgym train env=code data=arith`` (cold start included) for 20 GRPO steps on
    the GPU: a task smollm2-135m learns (``make demo``'s arith), so the reward curve means
    something. ``AGENTGYM_GPU_RUN_DIR`` keeps the run for ``make gpu-check``'s report."""
    run = Path(os.environ.get("AGENTGYM_GPU_RUN_DIR") or tmp_path / "grpo")
    cmd = [sys.executable, "-m", "agentgym.cli", "train", "env=code", "data=arith",
           "data.curriculum=solve_rate", f"run_dir={run}", "model=smollm2-135m",
           "trainer.total_steps=20", "trainer.prompts_per_step=8", "n=8", "trainer.lr=1e-5",
           "trainer.eval_limit=0", "trainer.save_every=20", "trainer.resume=never"]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=3600)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "rollout/reward" in m]
    assert [m["step"] for m in steps] == list(range(1, 21))
    assert all(m.get("perf/peak_memory_gb", 0) > 0 for m in steps)  # it ran on the GPU
    drift = [m["rollout/drift_mean"] for m in steps if "rollout/drift_mean" in m]
    assert drift and max(drift) < 0.05  # engine (bf16) and trainer (bf16 autocast) agree
    assert any(m["rollout/reward"] > 0 for m in steps)


def test_micro_batch_auto_on_cuda_is_a_budget_the_plan_fits():
    """``trainer.micro_batch_tokens=0`` on a GPU: one of the planner's candidates, the
    largest whose plan fits 80% of this device (a 135M model: more than the CPU's 4,096)."""
    from agentgym.config import build_config
    from agentgym.models.plan import AUTO_GPU_TOKENS, micro_batch_tokens
    cfg = build_config({"model": "smollm2-135m", "algo": "grpo", "trainer.device": "cuda"})
    tokens = micro_batch_tokens(cfg)
    assert tokens in AUTO_GPU_TOKENS and tokens > 4096, tokens
