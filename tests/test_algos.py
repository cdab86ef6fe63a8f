"""Pure RL functions and their invariances (accumulation, masked positions)."""

from __future__ import annotations

import pytest
import torch

from agentgym.config import Config, build_config
from agentgym.types import Trajectory
from trainers.algos import (aggregate, grpo_advantages, kl_estimate, ppo_clip_loss)
from trainers.batch import collate, micro_batches
from trainers.grpo import make_loss_fn


def test_grpo_advantages_loop_vs_vectorized():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    groups = [i // 4 for i in range(12)]
    adv = grpo_advantages(rewards, groups)
    for g in range(3):
        r = rewards[g * 4:(g + 1) * 4]
        expect = (r - r.mean()) / (r.std() + 1e-6)
        assert torch.allclose(adv[g * 4:(g + 1) * 4], expect, atol=1e-6)
    centered = grpo_advantages(rewards, groups, norm_by_std=False)
    assert torch.allclose(centered[:4], rewards[:4] - rewards[:4].mean())
    same = grpo_advantages(torch.ones(4), [0, 0, 0, 0])
    assert torch.equal(same, torch.zeros(4))
    assert grpo_advantages(torch.tensor([3.0]), ["solo"]).item() == 0.0


def test_ppo_clip_loss_values():
    mask = torch.ones(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    old = torch.zeros(1, 3)
    loss, m = ppo_clip_loss(old.clone(), old, adv, mask)
    assert torch.allclose(loss, -adv) and m["clipfrac"] == 0.0
    # Ratio e^1 with positive advantage is clipped at 1.2; negative advantage is not.
    logp = torch.tensor([[1.0, 1.0, -1.0]])
    loss, m = ppo_clip_loss(logp, old, adv, mask)
    assert loss[0, 0].item() == pytest.approx(-1.2)
    assert loss[0, 1].item() == pytest.approx(torch.e)
    assert loss[0, 2].item() == pytest.approx(-torch.exp(torch.tensor(-1.0)).item())
    dual, _ = ppo_clip_loss(logp, old, adv, mask, dual_clip=2.0)
    assert dual[0, 1].item() == pytest.approx(2.0)


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(v, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, mask, "seq-mean-token-sum-norm", norm_len=5).item() == \
        pytest.approx((6 / 5 + 4 / 5) / 2)
    with pytest.raises(ValueError, match="valid"):
        aggregate(v, mask, "mean")


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    k3 = kl_estimate(logp, ref, "k3")
    assert k3[1] == 0 and k3[0] == pytest.approx(float(torch.exp(torch.tensor(-0.5)) + 0.5 - 1))
    assert (kl_estimate(torch.randn(50), torch.randn(50), "k3") >= 0).all()


def test_micro_batches_respect_budget():
    groups = micro_batches([10, 20, 30, 5, 100, 5], max_tokens=60)
    assert sum(groups, []) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max([10, 20, 30, 5, 100, 5][i] for i in g) <= 60


def _toy_batch(tokenizer, seed=0):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(8):
        t = Trajectory(uid=str(i // 4), reward=float(i % 3))
        n_p, n_g, n_o, n_g2 = 3 + i % 2, 4 + i, 3, 2 + i % 3
        rand = lambda n: torch.randint(5, 300, (n,), generator=g).tolist()  # noqa: E731
        t.append("prompt", rand(n_p), 0)
        t.append("generated", rand(n_g), 0, logprobs=[-1.0] * n_g)
        t.append("observation", rand(n_o), 0)
        t.append("generated", rand(n_g2), 1, logprobs=[-1.0] * n_g2)
        trajs.append(t)
    batch = collate(trajs, tokenizer.pad_token_id)
    mask = batch.loss_mask
    batch.extra["old_logp"] = -torch.rand(mask.shape, generator=g) * mask
    batch.extra["adv"] = torch.randn(len(trajs), generator=g)[:, None] * mask
    batch.extra["ref_logp"] = -torch.rand(mask.shape, generator=g) * mask
    return batch


def _grads(model, batch, cfg, splits):
    model.zero_grad(set_to_none=True)
    loss_fn = make_loss_fn(cfg, 1.0, float(batch.loss_mask.sum()), len(batch), 64)
    total = 0.0
    for idx in splits:
        loss, _ = loss_fn(model, batch.select(idx))
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)  # the model is shared with other tests
    return total, grads


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grad_accumulation_1x8_equals_8x1(tiny_model, tiny_tokenizer, mode):
    cfg = build_config({"algo.loss_agg_mode": mode, "algo.kl_coef": 0.1})
    batch = _toy_batch(tiny_tokenizer)
    l1, g1 = _grads(tiny_model, batch, cfg, [list(range(8))])
    l8, g8 = _grads(tiny_model, batch, cfg, [[i] for i in range(8)])
    assert l1 == pytest.approx(l8, rel=1e-5)
    for name in g1:
        assert torch.allclose(g1[name], g8[name], atol=1e-6, rtol=1e-4), name


def test_values_at_masked_positions_do_not_matter(tiny_model, tiny_tokenizer):
    cfg = build_config({"algo.kl_coef": 0.1, "algo.entropy_coef": 0.01})
    batch = _toy_batch(tiny_tokenizer)
    loss_a, g_a = _grads(tiny_model, batch, cfg, [list(range(8))])
    off = 1 - batch.loss_mask
    for key in ("old_logp", "adv", "ref_logp"):
        batch.extra[key] = batch.extra[key] + 123.0 * torch.randn(off.shape) * off
    loss_b, g_b = _grads(tiny_model, batch, cfg, [list(range(8))])
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-7), name


def test_algo_config_errors():
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        build_config({"algo.loss_agg_mode": "token_mean"})
    assert isinstance(build_config({}), Config)
