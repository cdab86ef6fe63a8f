"""Sharded backends against the single-process one: real gloo process groups of 2 ranks
(spawned processes), FSDP2 and DeepSpeed ZeRO-1/2/3, the same batches and loss for
several optimizer steps; losses, metrics, logprobs and weights must agree."""

from __future__ import annotations

import pytest
import torch

from agentgym.config import build_config
from agentgym.core.types import Trajectory
from agentgym.trainers.backends.base import ModelSpec
from agentgym.trainers.backends.distributed import DistributedBackend
from agentgym.trainers.backends.ranks import OptimSpec
from agentgym.trainers.backends.single import SingleBackend
from agentgym.trainers.batch import collate
from agentgym.trainers.phases import make_loss_fn

STEPS = 3
# Measured agreement with the single backend on `tiny` (fp32, lr 1e-2, 3 AdamW steps that
# move the weights by ~3e-2), which is rounding and so depends on the CPU's matrix kernels:
# on a Xeon with AVX-512, losses within 1.4e-8 relative, weights within 1.1e-6 (FSDP2,
# ZeRO-1/2) and 1.5e-5 (ZeRO-3), logprobs within 4.8e-6; on an AMD EPYC with AVX2 only
# (MKL's zen kernels), losses within 8e-8, weights within 1.5-1.7e-5 and logprobs within
# 2.6-2.7e-5 on every backend (AdamW's normalised step magnifies the last bits of small
# gradients). The bounds leave room over both; a real difference (the policy after those
# three steps against the untrained model) is 2.1 in logprob, 2e4 times LPTOL.
RTOL, WATOL, LPTOL = 1e-6, 1e-4, 1e-4


def _batches(tokenizer, steps: int = STEPS):
    """Per step: 7 multi-turn trajectories of different lengths (uneven micro-batches)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for s in range(steps):
        trajs = []
        for i in range(7):
            t = Trajectory(uid=str(i // 3), reward=float((i + s) % 3))
            rand = lambda n: torch.randint(5, 300, (n,), generator=g).tolist()  # noqa: E731
            n1, n2 = 3 + (i * 5 + s) % 11, 2 + i % 4
            t.append("prompt", rand(4 + i % 3), 0)
            t.append("generated", rand(n1), 0, logprobs=[-1.0] * n1)
            t.append("observation", rand(3), 0)
            t.append("generated", rand(n2), 1, logprobs=[-1.0] * n2)
            trajs.append(t)
        b = collate(trajs, tokenizer.pad_token_id)
        mask = b.loss_mask
        b.old_logp = -torch.rand(mask.shape, generator=g) * mask - 3.0
        b.adv = torch.randn(len(trajs), generator=g)[:, None] * mask
        out.append(b)
    return out


def _run(backend, batches, cfg):
    losses, metrics = [], []
    for b in batches:
        n_tok = float(b.loss_mask.sum())
        res = backend.train_step(backend.split(b), make_loss_fn(cfg, 1.0, n_tok, len(b), 64))
        losses.append(res["loss"])
        metrics.append(res)
    lp, ent = backend.logprobs(batches[0], 1.0, with_entropy=True)
    return losses, metrics, lp, ent, backend.state_dict()


@pytest.fixture(scope="module")
def reference(tiny_path, tiny_tokenizer):
    cfg = build_config({})
    batches = _batches(tiny_tokenizer)
    single = SingleBackend(ModelSpec(str(tiny_path)).load(), lr=1e-2, micro_batch_tokens=64)
    return cfg, batches, _run(single, batches, cfg)


@pytest.mark.parametrize("kind,stage,offload", [
    ("fsdp", 0, False), ("deepspeed", 1, False), ("deepspeed", 2, False), ("deepspeed", 3, False),
    # ZeRO-Offload: optimizer state and step on the CPU with DeepSpeedCPUAdam (its first
    # run JIT-builds the op, ~75 s here)
    pytest.param("deepspeed", 2, True, marks=pytest.mark.slow)])
def test_sharded_backends_match_single(reference, tiny_path, kind, stage, offload):
    cfg, batches, (losses, metrics, lp, ent, weights) = reference
    backend = DistributedBackend(kind, ModelSpec(str(tiny_path)),
                                 OptimSpec(lr=1e-2, zero_stage=stage or 2, offload=offload), 2, 64)
    try:
        d_losses, d_metrics, d_lp, d_ent, d_weights = _run(backend, batches, cfg)
    finally:
        backend.close()
    assert d_losses == pytest.approx(losses, rel=RTOL)
    for a, b in zip(metrics, d_metrics):
        for key in ("pg_loss", "entropy", "grad_norm", "lr", "clipfrac"):
            assert b[key] == pytest.approx(a[key], rel=RTOL, abs=1e-6), key
    torch.testing.assert_close(d_lp, lp, atol=LPTOL, rtol=0)
    torch.testing.assert_close(d_ent, ent, atol=LPTOL, rtol=0)
    assert d_weights.keys() == weights.keys()
    for k in weights:
        torch.testing.assert_close(d_weights[k], weights[k], atol=WATOL, rtol=0), k
    # the steps moved the weights far more than the disagreement
    init = ModelSpec(str(tiny_path)).load().state_dict()
    assert max(float((weights[k] - init[k]).abs().max()) for k in weights) > 100 * WATOL


@pytest.fixture(scope="module")
def lora_reference(tiny_path, tiny_tokenizer):
    from agentgym.trainers.lora import LoraSpec
    cfg = build_config({})
    spec = ModelSpec(str(tiny_path), lora=LoraSpec(4, 8.0))
    batches = _batches(tiny_tokenizer)
    single = SingleBackend(spec.load(), lr=1e-2, micro_batch_tokens=64)
    return cfg, spec, batches, _run(single, batches, cfg)


@pytest.mark.parametrize("kind,stage", [("fsdp", 0), ("deepspeed", 3)])
def test_sharded_lora_matches_single(lora_reference, kind, stage):
    """LoRA adapters trained on 2 ranks: the same losses and merged weights as one."""
    cfg, spec, batches, (losses, _, lp, _, weights) = lora_reference
    backend = DistributedBackend(kind, spec, OptimSpec(lr=1e-2, zero_stage=stage or 2), 2, 64)
    try:
        d_losses, _, d_lp, _, d_weights = _run(backend, batches, cfg)
    finally:
        backend.close()
    assert d_losses == pytest.approx(losses, rel=RTOL)
    torch.testing.assert_close(d_lp, lp, atol=LPTOL, rtol=0)
    assert d_weights.keys() == weights.keys() and not any("lora" in k for k in weights)
    for k in weights:
        torch.testing.assert_close(d_weights[k], weights[k], atol=WATOL, rtol=0), k


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_sharded_reference_lives_in_the_ranks(tiny_path, tiny_tokenizer, kind):
    """The KL reference of a sharded backend (loaded in the ranks, sharded as the policy
    is) gives the local reference's logprobs, and stays put while the policy trains."""
    from agentgym.trainers.backends.base import batched_logprobs
    from agentgym.models.zoo import load_model
    cfg = build_config({})
    batches = _batches(tiny_tokenizer)
    local, _ = batched_logprobs(load_model(tiny_path, device="cpu"), batches[0], 0.7, 64)
    backend = DistributedBackend(kind, ModelSpec(str(tiny_path)),
                                 OptimSpec(lr=1e-2, zero_stage=2), 2, 64, logprob_chunk=5)
    try:
        before = backend.reference_logprobs(batches[0], 0.7)
        _run(backend, batches, cfg)  # the policy moves ...
        policy, _ = backend.logprobs(batches[0], 0.7)
        after = backend.reference_logprobs(batches[0], 0.7)
    finally:
        backend.close()
    torch.testing.assert_close(before, local, atol=LPTOL, rtol=0)
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # ... the reference does not
    assert (policy - local).abs().max() > 100 * LPTOL


def test_both_backends_satisfy_the_backend_protocol():
    """Every method of :class:`Backend` exists on both backends and takes the protocol's
    parameters (same names, same order, defaults where it has them)."""
    import inspect

    from agentgym.trainers.backends.base import Backend
    from agentgym.trainers.backends.distributed import DistributedBackend
    from agentgym.trainers.backends.single import SingleBackend
    members = [n for n, v in vars(Backend).items()
               if callable(v) and not n.startswith("_")]
    assert {"logprobs", "split", "train_step", "state_dict", "close"} <= set(members)
    for cls in (SingleBackend, DistributedBackend):
        for name in members:
            want = list(inspect.signature(getattr(Backend, name)).parameters.values())
            got = list(inspect.signature(getattr(cls, name)).parameters.values())
            assert [p.name for p in got[:len(want)]] == [p.name for p in want], (cls, name)
            assert all(p.default is not inspect.Parameter.empty for p in got[len(want):]), \
                (cls, name)  # anything more is optional
            assert all(g.default is not inspect.Parameter.empty for w, g in zip(want, got)
                       if w.default is not inspect.Parameter.empty), (cls, name)


@pytest.mark.parametrize("kind,stage", [("fsdp", 0), ("deepspeed", 2)])
def test_a_sharded_step_at_half_rate_is_the_half_rate_step(tiny_path, tiny_tokenizer, kind,
                                                           stage):
    """``train_step(lr_scale=0.5)`` reaches every rank's optimizer (the SFT's per-env rate):
    at rate r it moves the weights exactly as the same backend at r / 2 does, reports
    r / 2, and the next step is back on r's schedule."""
    cfg = build_config({})
    batches = _batches(tiny_tokenizer, steps=2)
    out = {}
    for lr, scale in ((1e-2, 0.5), (5e-3, 1.0)):
        backend = DistributedBackend(kind, ModelSpec(str(tiny_path)),
                                     OptimSpec(lr=lr, zero_stage=stage or 2), 2, 64)
        try:
            b = batches[0]
            loss = make_loss_fn(cfg, 1.0, float(b.loss_mask.sum()), len(b), 64)
            first = backend.train_step(backend.split(b), loss, lr_scale=scale)
            weights = backend.state_dict()
            b = batches[1]
            loss = make_loss_fn(cfg, 1.0, float(b.loss_mask.sum()), len(b), 64)
            out[scale] = (first["lr"], weights, backend.train_step(backend.split(b), loss)["lr"])
        finally:
            backend.close()
    (lr_a, w_a, next_a), (lr_b, w_b, next_b) = out[0.5], out[1.0]
    assert lr_a == pytest.approx(5e-3) and lr_b == pytest.approx(5e-3)
    for k in w_a:
        torch.testing.assert_close(w_a[k], w_b[k], atol=0, rtol=0), k
    assert next_a == pytest.approx(1e-2) and next_b == pytest.approx(5e-3)
