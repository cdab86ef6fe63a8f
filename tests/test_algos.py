"""The RL math (trainers/algos.py): hand-computed values for every estimator and loss,
loop-versus-vectorized equivalence, mask invariance, GAE bootstrapping on truncated vs
terminated episodes, and the micro-batching invariances of the policy loss."""

from __future__ import annotations

import math

import pytest
import torch

from agentgym.config import ALGO_PRESETS, Config, build_config
from agentgym.core.types import Trajectory
from agentgym.trainers.algos import (ADVANTAGES, POLICY_LOSSES, aggregate, compute_advantages,
                            compute_policy_loss, dual_clip_loss, gae_advantages,
                            grpo_advantages, groups_with_signal, gspo_loss, kl_estimate,
                            masked_whiten, overlong_penalty, ppo_clip_loss,
                            reinforce_pp_advantages, reinforce_pp_baseline_advantages,
                            rloo_advantages, value_loss)
from agentgym.trainers.batch import collate, micro_batches
from agentgym.trainers.phases import make_loss_fn

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")


def _outcome(scores, T=4):
    """``(B,)`` scores → (rewards, mask) with one sampled token per row, the last one."""
    B = len(scores)
    mask = torch.zeros(B, T)
    mask[:, -1] = 1
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.as_tensor(scores, dtype=torch.float32)
    return rewards, mask


# --- a multi-turn row, worked by hand ----------------------------------------------------
# positions: 0 prompt | 1, 2 sampled (turn 0) | 3, 4 observation | 5 sampled (turn 1)
MT_MASK = torch.tensor([[0.0, 1, 1, 0, 0, 1]])
MT_REWARDS = torch.tensor([[0.0, 0, 0.5, 0, 0, 1.0]])  # turn rewards on each turn's last token
MT_VALUES = torch.tensor([[9.0, 0.2, 0.4, 7.0, 7.0, 0.6]])  # 9 and 7: junk at mask 0


def test_gae_hand_computed_multi_turn_terminated():
    # gamma 0.9, lam 0.8 over the sampled positions 1, 2, 5 (observations skipped):
    #   pos 5: delta = 1.0 + 0.9*0 - 0.6 = 0.4                      A = 0.4
    #   pos 2: delta = 0.5 + 0.9*0.6 - 0.4 = 0.64                   A = 0.64 + 0.72*0.4 = 0.928
    #   pos 1: delta = 0.0 + 0.9*0.4 - 0.2 = 0.16                   A = 0.16 + 0.72*0.928 = 0.82816
    adv, ret = gae_advantages(MT_REWARDS, MT_MASK, values=MT_VALUES, gamma=0.9, lam=0.8,
                              norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.82816, 0.928, 0, 0, 0.4]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.02816, 1.328, 0, 0, 1.0]]))


def test_gae_bootstraps_truncated_but_not_terminated():
    last = torch.tensor([2.0])
    kw = dict(values=MT_VALUES, gamma=0.9, lam=0.8, norm_by_std=False)
    term, _ = gae_advantages(MT_REWARDS, MT_MASK, last_values=last,
                             truncated=torch.tensor([False]), **kw)
    trunc, _ = gae_advantages(MT_REWARDS, MT_MASK, last_values=last,
                              truncated=torch.tensor([True]), **kw)
    # terminated: the value after the last token is 0, whatever last_values says
    no_last, _ = gae_advantages(MT_REWARDS, MT_MASK, **kw)
    torch.testing.assert_close(term, no_last)
    other, _ = gae_advantages(MT_REWARDS, MT_MASK, last_values=torch.tensor([-50.0]),
                              truncated=torch.tensor([False]), **kw)
    torch.testing.assert_close(term, other)
    # truncated: gamma * V_last enters the last delta and flows back by (gamma*lam)^k
    boost = 0.9 * 2.0
    want = term + torch.tensor([[0.0, 0.72 ** 2 * boost, 0.72 * boost, 0, 0, boost]])
    torch.testing.assert_close(trunc, want)
    with pytest.raises(ValueError, match="last_values"):
        gae_advantages(MT_REWARDS, MT_MASK, values=MT_VALUES, truncated=torch.tensor([True]))


def test_reinforce_pp_hand_computed():
    # gamma 0.5 over sampled positions 1, 2, 5: G5 = 1, G2 = 0.5 + 0.5*1 = 1, G1 = 0.5*1
    adv, ret = reinforce_pp_advantages(MT_REWARDS, MT_MASK, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.5, 1.0, 0, 0, 1.0]]))
    # whitened over the 3 sampled tokens: mean 5/6, unbiased std sqrt(1/12)
    s = math.sqrt(1 / 12)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1 / 3 / s, 1 / 6 / s, 0, 0, 1 / 6 / s]]),
                               atol=1e-5, rtol=1e-4)


def test_grpo_and_dr_grpo_hand_computed():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 7.0])
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv, ret = grpo_advantages(rewards, mask, group_ids=groups)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    want = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]) / (std + 1e-6)
    want[4:] = 0  # b: all equal; c: a group of one
    torch.testing.assert_close(adv[:, -1], want)
    torch.testing.assert_close(ret[:, -1], rewards[:, -1])
    dr, _ = grpo_advantages(rewards, mask, group_ids=groups, norm_by_std=False)
    torch.testing.assert_close(dr[:, -1], torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))
    assert float(adv[:, :-1].abs().sum()) == 0.0  # nothing off the mask
    # equal rewards that are not exactly representable still give exactly 0
    # (in float32 the mean of three 0.9s is not 0.9: std-normalizing the rounding error
    # would give advantages of about +-0.06)
    for scores in ([0.9] * 3, [0.1] * 7):
        flat, _ = grpo_advantages(*_outcome(scores), group_ids=[0] * len(scores))
        assert float(flat.abs().sum()) == 0.0
        flat, _ = rloo_advantages(*_outcome(scores), group_ids=[0] * len(scores))
        assert float(flat.abs().sum()) == 0.0


def test_rloo_hand_computed():
    rewards, mask = _outcome([1.0, 0.0, 0.0, 1.0, 5.0, 0.5, 1.5])
    adv, _ = rloo_advantages(rewards, mask, group_ids=["a", "a", "a", "a", "b", "c", "c"])
    # a: r_i minus the mean of the other three; b: alone, no baseline; c: a pair
    torch.testing.assert_close(adv[:, -1], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0,
                                                          -1.0, 1.0]))
    dr, _ = grpo_advantages(rewards[:4], mask[:4], group_ids=["a"] * 4, norm_by_std=False)
    torch.testing.assert_close(adv[:4], 4 / 3 * dr)  # n/(n-1) x Dr. GRPO


def test_reinforce_pp_baseline_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1], [1.0, 1, 1], [0.0, 1, 0]])
    adv, ret = reinforce_pp_baseline_advantages(rewards, mask, group_ids=["a", "a", "b"])
    # R - group mean: a: +0.5 (2 tokens), -0.5 (3 tokens); b: 0 (1 token)
    x = torch.tensor([0.5, 0.5, -0.5, -0.5, -0.5, 0.0])
    w = (x - x.mean()) / x.std()
    torch.testing.assert_close(adv[mask > 0], w, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1, 1], [0.0, 0, 0], [0.0, 2, 0]]))


# --- loop references vs the vectorized estimators -----------------------------------------
def _random_multi_turn(seed: int, B: int = 6, T: int = 24):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    rewards = torch.zeros(B, T)
    for b in range(B):
        pos = int(torch.randint(1, 4, (1,), generator=g))  # prompt
        while pos < T - 1:
            n = int(torch.randint(1, 5, (1,), generator=g))
            mask[b, pos:pos + n] = 1  # a turn's sampled tokens ...
            last = min(pos + n, T) - 1
            rewards[b, last] = float(torch.randn(1, generator=g))  # ... its reward at its end
            pos += n + int(torch.randint(0, 4, (1,), generator=g))  # then an observation
    values = torch.randn(B, T, generator=g)
    last_values = torch.randn(B, generator=g)
    truncated = torch.rand(B, generator=g) < 0.5
    groups = [b // 3 for b in range(B)]
    return rewards, mask, values, last_values, truncated, groups


def _gae_loop(rewards, mask, values, last_values, truncated, gamma, lam):
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        nxt = float(last_values[b]) if truncated[b] else 0.0
        running = 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * nxt - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            nxt = float(values[b, t])
    return adv


def _whiten_loop(x, mask):
    vals = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m > 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return torch.where(mask > 0, (x - mean) / std, 0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_and_reinforce_pp_loop_vs_vectorized(seed):
    rewards, mask, values, last_values, truncated, groups = _random_multi_turn(seed)
    gamma, lam = 0.95, 0.9
    want = _gae_loop(rewards, mask, values, last_values, truncated, gamma, lam)
    adv, ret = gae_advantages(rewards, mask, values=values, last_values=last_values,
                              truncated=truncated, gamma=gamma, lam=lam, norm_by_std=False)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.where(mask > 0, want + values, 0.0), atol=1e-5,
                               rtol=1e-5)
    white, _ = gae_advantages(rewards, mask, values=values, last_values=last_values,
                              truncated=truncated, gamma=gamma, lam=lam)
    torch.testing.assert_close(white, _whiten_loop(want, mask), atol=1e-4, rtol=1e-4)
    # REINFORCE++: returns are GAE with V = 0, lambda = 1, no bootstrap
    g = _gae_loop(rewards, mask, torch.zeros_like(values), last_values,
                  torch.zeros_like(truncated), gamma, 1.0)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    torch.testing.assert_close(ret, g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv, _whiten_loop(g, mask), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_group_estimators_loop_vs_vectorized(seed):
    rewards, mask, *_ = _random_multi_turn(seed, B=12)
    groups = [["x", "y", "z"][b % 3] for b in range(12)]
    scores = [float((rewards[b] * mask[b]).sum()) for b in range(12)]
    members = {g: [s for s, h in zip(scores, groups) if h == g] for g in set(groups)}
    mean = {g: sum(v) / len(v) for g, v in members.items()}
    std = {g: math.sqrt(sum((x - mean[g]) ** 2 for x in v) / (len(v) - 1))
           for g, v in members.items()}
    grpo, _ = grpo_advantages(rewards, mask, group_ids=groups)
    rloo, _ = rloo_advantages(rewards, mask, group_ids=groups)
    base, _ = reinforce_pp_baseline_advantages(rewards, mask, group_ids=groups)
    raw = torch.zeros_like(rewards)
    for b, (s, g) in enumerate(zip(scores, groups)):
        n = len(members[g])
        for t in range(rewards.shape[1]):
            if mask[b, t] > 0:
                assert float(grpo[b, t]) == pytest.approx((s - mean[g]) / (std[g] + 1e-6),
                                                          abs=1e-5)
                assert float(rloo[b, t]) == pytest.approx(s - (sum(members[g]) - s) / (n - 1),
                                                          abs=1e-5)
                raw[b, t] = s - mean[g]
    torch.testing.assert_close(base, _whiten_loop(raw, mask), atol=1e-4, rtol=1e-4)


# --- mask invariance -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimators_ignore_everything_at_mask_zero(name):
    rewards, mask, values, last_values, truncated, groups = _random_multi_turn(5)
    kw = dict(group_ids=groups, last_values=last_values, truncated=truncated, gamma=0.97,
              lam=0.9)
    a, r = compute_advantages(name, rewards, mask, values=values, **kw)
    off = 1 - mask
    noisy_values = values + 1e3 * torch.randn(values.shape) * off
    noisy_rewards = rewards + 1e3 * torch.randn(rewards.shape) * off
    b, s = compute_advantages(name, noisy_rewards, mask, values=noisy_values, **kw)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(r, s)
    assert float((a * off).abs().sum()) == 0.0 and float((r * off).abs().sum()) == 0.0


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo"])
def test_policy_losses_ignore_everything_at_mask_zero(name):
    _, mask, *_ = _random_multi_turn(3)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g)
    adv = torch.randn(mask.shape[0], 1, generator=g) * mask
    base = old + 0.3 * torch.randn(mask.shape, generator=g)
    params = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    off = 1 - mask

    def run(logp0, old_, adv_):
        logp = logp0.clone().requires_grad_()
        loss, _ = compute_policy_loss(name, logp, old_, adv_, mask, **params)
        total = aggregate(loss, mask, "token-mean")
        total.backward()
        return float(total.detach()), logp.grad

    l1, g1 = run(base, old, adv)
    l2, g2 = run(base + 50 * torch.randn(mask.shape) * off, old + 9 * off, adv - 7 * off)
    assert l1 == pytest.approx(l2, rel=1e-6)
    torch.testing.assert_close(g1, g2)
    assert float((g1 * off).abs().sum()) == 0.0


def test_value_loss_hand_computed_and_mask_invariant():
    mask = torch.tensor([[0.0, 1, 1, 1]])
    ret = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.9, 0.0]])
    v = torch.tensor([[5.0, 2.0, 1.2, -0.1]])
    loss, m = value_loss(v, old, ret, mask, clip=0.5)
    # pos 1: unclipped (2-1)^2 = 1, clipped (0.5-1)^2 = 0.25 -> 0.5*1
    # pos 2: unclipped 0.04, clipped 0.9+0.3=1.2 -> 0.04 -> 0.02; pos 3: 0.01 both -> 0.005
    torch.testing.assert_close(loss, torch.tensor([[0.0, 0.5, 0.02, 0.005]]))
    assert m["vf_clipfrac"] == 0.0
    # a large move with the clipped error larger: pos 1 goes 0 -> -2 (clipped -0.5)
    loss, m = value_loss(torch.tensor([[0.0, -2.0, 1.0, 0.0]]), old, ret, mask, clip=0.5)
    assert float(loss[0, 1]) == pytest.approx(0.5 * 9.0) and m["vf_clipfrac"] == 0.0
    loss, m = value_loss(torch.tensor([[0.0, 2.0, 1.0, 0.0]]), old, ret, mask, clip=0.5)
    assert float(loss[0, 1]) == pytest.approx(0.5 * 1.0)
    noisy, _ = value_loss(v + 100 * (1 - mask), old - 3 * (1 - mask), ret + 7 * (1 - mask),
                          mask, clip=0.5)
    torch.testing.assert_close(noisy, value_loss(v, old, ret, mask, clip=0.5)[0])
    unclipped, _ = value_loss(v, old, ret, mask, clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([[0.0, 0.5, 0.02, 0.005]]))


# --- policy losses, by hand -------------------------------------------------------------------
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
    assert loss[0, 2].item() == pytest.approx(-math.exp(-1.0))
    dual, m = dual_clip_loss(logp, old, adv, mask, dual_clip=2.0)
    assert dual[0, 1].item() == pytest.approx(2.0)  # e > 2: bounded at -2 * A
    assert dual[0, 0].item() == pytest.approx(-1.2) and m["dual_clipfrac"] == pytest.approx(1 / 3)
    dual3, _ = dual_clip_loss(logp, old, adv, mask)  # default c = 3 > e: not bounded
    assert dual3[0, 1].item() == pytest.approx(torch.e)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        dual_clip_loss(logp, old, adv, mask, dual_clip=1.0)


def test_clip_higher_is_asymmetric():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 0.75]]))
    adv = torch.tensor([[1.0, -1.0]])
    sym, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(sym, torch.tensor([[-1.2, 0.8]]))  # both clipped
    assert m["clipfrac"] == 1.0
    higher, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # DAPO's clip-higher: the positive-advantage token may rise to 1.28, the low side stays
    torch.testing.assert_close(higher, torch.tensor([[-1.25, 0.8]]))
    assert m["clipfrac"] == 0.5


def test_gspo_loss_sequence_ratio_value_and_gradient():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    logp = (old + torch.tensor([[9.0, 0.2, -0.1, 7.0]])).requires_grad_()  # junk at mask 0
    adv = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, m = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s = torch.exp(torch.tensor(0.05))  # mean of 0.2 and -0.1 over the two sampled tokens
    torch.testing.assert_close(loss, torch.tensor([[0.0, -s, -s, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -s, -s, 0.0]]))
    assert m["clipfrac"] == 0.0
    # a tight clip (the paper's scale) clips this sequence: value 1+eps, no gradient
    logp.grad = None
    loss, m = gspo_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    torch.testing.assert_close(loss[0, 1], torch.tensor(-(1 + 4e-4)))
    loss.sum().backward()
    assert float(logp.grad.abs().sum()) == 0.0 and m["clipfrac"] == 1.0


def test_gspo_ignores_other_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    a, _ = gspo_loss(torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, 0.0]]), old, adv, mask,
                     clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(a[0, :2], torch.tensor([-1.2, -1.2]))  # e^0.2 > 1.2: clipped
    torch.testing.assert_close(a[1, 0], torch.exp(torch.tensor(-0.2)))


# --- aggregation, KL, whitening ---------------------------------------------------------------
def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(v, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(v, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(v, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(v, mask, "seq-mean-token-sum-norm", norm_len=5).item() == \
        pytest.approx((6 / 5 + 4 / 5) / 2)
    # a NaN or inf at a masked position cannot leak into any mode
    bad = v.clone()
    bad[1, 1], bad[1, 2] = float("nan"), float("inf")
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(bad, mask, mode).item() == aggregate(v, mask, mode).item()
    with pytest.raises(ValueError, match="valid"):
        aggregate(v, mask, "mean")


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    ref = torch.tensor([-1.5, -2.0, 9.0])
    mask = torch.tensor([1.0, 1.0, 0.0])  # the third token is not the policy's
    assert torch.allclose(kl_estimate(logp, ref, mask, "k1"), torch.tensor([0.5, 0.0, 0.0]))
    assert torch.allclose(kl_estimate(logp, ref, mask, "k2"), torch.tensor([0.125, 0.0, 0.0]))
    k3 = kl_estimate(logp, ref, mask, "k3")
    assert k3[1] == 0 and k3[2] == 0 and k3[0] == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    ones = torch.ones(50)
    assert (kl_estimate(torch.randn(50), torch.randn(50), ones, "k3") >= 0).all()
    # k1 and k3 are unbiased: their means over samples from pi approach KL(pi || ref)
    g = torch.Generator().manual_seed(0)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    true_kl = float((p * (p / q).log()).sum())
    for kind in ("k1", "k3"):
        est = float(kl_estimate(p[x].log(), q[x].log(), torch.ones(len(x)), kind).mean())
        assert est == pytest.approx(true_kl, abs=0.01), kind
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, mask, "k4")


def test_masked_whiten_uses_only_masked_entries():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    w = masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(w[mask > 0], (vals - 2.5) / vals.std(), atol=1e-5, rtol=1e-5)
    assert float(w[mask == 0].abs().sum()) == 0.0


# --- DAPO pieces ---------------------------------------------------------------------------
def test_groups_with_signal():
    keep = groups_with_signal([1, 1, 0, 1, 0.5, 0.5, 2], ["a", "a", "a", "a", "b", "b", "c"])
    assert keep == [True, True, True, True, False, False, False]


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 80, 90, 95, 100])
    pen = overlong_penalty(lengths, max_len=100, buffer=20)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, 100, 20, factor=0.5), pen / 2)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 100, 0)


# --- registries and config ---------------------------------------------------------------
def test_registries_hold_the_named_algorithms():
    assert set(ESTIMATORS) <= set(ADVANTAGES.names())
    assert {"ppo_clip", "dual_clip", "gspo"} <= set(POLICY_LOSSES.names())
    with pytest.raises(KeyError, match="rloo"):
        ADVANTAGES.get("rlooo")
    with pytest.raises(KeyError, match="gspo"):
        POLICY_LOSSES.get("gspoo")
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", *_outcome([1.0]), group_ids=[0])


def test_the_config_and_the_registry_agree_on_which_estimators_need_a_critic(monkeypatch):
    """``AlgoConfig.needs_critic`` (what the trainer and ``agentgym plan`` ask) says of every
    registered estimator what its registration says; an estimator registered elsewhere that
    disagrees stops the run before anything loads."""
    from agentgym.config import AlgoConfig
    from agentgym.trainers.phases import check_algo
    for name in ADVANTAGES.names():
        reads_values = bool(ADVANTAGES.extras(name).get("needs_critic", False))
        assert AlgoConfig(advantage=name).needs_critic == reads_values, name
    assert {n for n in ADVANTAGES.names() if AlgoConfig(advantage=n).needs_critic} == \
        {"gae", "gae_turn"}
    monkeypatch.setitem(ADVANTAGES._entries, "my_gae", gae_advantages)  # a user's estimator
    monkeypatch.setitem(ADVANTAGES._extras, "my_gae", {"needs_critic": True})
    with pytest.raises(ValueError, match="'my_gae' is registered with needs_critic=True"):
        check_algo(build_config({"algo.advantage": "my_gae", "rollout.n": 1}))


def test_algo_presets_and_errors():
    ppo = build_config({"algo": "ppo"})
    assert ppo.algo.advantage == "gae" and ppo.rollout.n == 1
    # the preset sits under the user's overrides
    assert build_config({"algo": "ppo", "rollout.n": 4}).rollout.n == 4
    dapo = build_config({"algo": "dapo"})
    assert dapo.algo.clip_high == 0.28 and dapo.algo.dynamic_sampling
    assert build_config({"algo.name": "dr_grpo"}).algo.norm_adv_by_std is False
    for name, preset in ALGO_PRESETS.items():
        cfg = build_config({"algo": name})
        ADVANTAGES.get(cfg.algo.advantage)  # every preset names registered entries
        POLICY_LOSSES.get(cfg.algo.policy_loss)
        for key, value in preset.items():
            section, attr = key.split(".")
            assert getattr(getattr(cfg, section), attr) == value, (name, key)
    with pytest.raises(ValueError, match="did you mean 'ppo'"):
        build_config({"algo": "ppp"})
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        build_config({"algo.loss_agg_mode": "token_mean"})
    with pytest.raises(ValueError, match="algo.gamma"):
        build_config({"algo.gamma": 1.5})
    assert isinstance(build_config({}), Config)


# --- the policy loss inside the recipe: accumulation and masked positions -------------------
def test_micro_batches_respect_budget():
    groups = micro_batches([10, 20, 30, 5, 100, 5], max_tokens=60)
    assert sum(groups, []) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max([10, 20, 30, 5, 100, 5][i] for i in g) <= 60


def test_collate_puts_each_turn_reward_on_its_last_sampled_token():
    t = Trajectory(uid="u", step_rewards=[0.25, 1.0], reward=1.25, truncated=True)
    t.append("prompt", [5, 6, 7], 0)
    t.append("generated", [8, 9], 0, logprobs=[-1.0, -1.0])
    t.append("filler", [10], 0)
    t.append("observation", [11, 12], 0)
    t.append("generated", [13, 14, 15], 1, logprobs=[-1.0] * 3)
    b = collate([t, Trajectory(uid="v", reward=2.0, token_ids=[1, 2], loss_mask=[0, 1],
                               logprobs=[0.0, -0.5])], pad_id=0)
    torch.testing.assert_close(b.token_rewards[0], torch.tensor(
        [0, 0, 0, 0, 0.25, 0, 0, 0, 0, 0, 1.0]))
    assert float(b.token_rewards[1, 1]) == 2.0  # no per-turn rewards: the last sampled token
    assert b.truncated.tolist() == [True, False]


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
    batch.old_logp = -torch.rand(mask.shape, generator=g) * mask
    batch.adv = torch.randn(len(trajs), generator=g)[:, None] * mask
    batch.ref_logp = -torch.rand(mask.shape, generator=g) * mask
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


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "dual_clip", "gspo"])
def test_values_at_masked_positions_do_not_matter(tiny_model, tiny_tokenizer, policy_loss):
    cfg = build_config({"algo.kl_coef": 0.1, "algo.entropy_coef": 0.01,
                        "algo.policy_loss": policy_loss})
    batch = _toy_batch(tiny_tokenizer)
    loss_a, g_a = _grads(tiny_model, batch, cfg, [list(range(8))])
    off = 1 - batch.loss_mask
    for key in ("old_logp", "adv", "ref_logp"):
        setattr(batch, key, getattr(batch, key) + 123.0 * torch.randn(off.shape) * off)
    loss_b, g_b = _grads(tiny_model, batch, cfg, [list(range(8))])
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-7), name


def test_update_reusing_its_own_logprobs_equals_a_separate_old_pass(tiny_model, tiny_tokenizer):
    from agentgym.trainers.backends.base import batched_logprobs
    cfg = build_config({"algo.kl_coef": 0.1})
    batch = _toy_batch(tiny_tokenizer)
    batch.old_logp, _ = batched_logprobs(tiny_model, batch, 1.0, 4096)
    loss_a, g_a = _grads(tiny_model, batch, cfg, [[0, 1, 2], [3, 4, 5, 6, 7]])
    batch.old_logp = None  # as the recipe leaves it with one optimizer step per batch
    loss_b, g_b = _grads(tiny_model, batch, cfg, [list(range(8))])
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=1e-6, rtol=1e-4), name


def test_logprobs_skip_the_prompt_projection_exactly(tiny_model, tiny_tokenizer):
    from agentgym.trainers.backends.base import first_needed_position, sequence_logprobs
    batch = _toy_batch(tiny_tokenizer)
    start = first_needed_position(batch.loss_mask)
    assert start == 3  # the shortest prompt is 3 tokens: the first sampled token is at 3
    with torch.no_grad():
        full, ent_full = sequence_logprobs(tiny_model, batch.input_ids, batch.attention_mask,
                                           0.7, with_entropy=True)
        cut, ent_cut = sequence_logprobs(tiny_model, batch.input_ids, batch.attention_mask,
                                         0.7, with_entropy=True, start=start)

        class NoKeep(torch.nn.Module):  # a model whose forward has no logits_to_keep
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_ids, attention_mask):
                return self.m(input_ids=input_ids, attention_mask=attention_mask)
        other, _ = sequence_logprobs(NoKeep(tiny_model), batch.input_ids,
                                     batch.attention_mask, 0.7, start=start)
    torch.testing.assert_close(cut[:, start:], full[:, start:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_cut[:, start:], ent_full[:, start:], atol=1e-5, rtol=1e-5)
    assert float(cut[:, :start].abs().sum()) == 0.0
    torch.testing.assert_close(other, cut, atol=1e-5, rtol=1e-5)


def test_off_policy_weights_by_hand():
    from agentgym.trainers.algos import behaviour_weights
    prox = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.3]]))
    behav = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ones, none = behaviour_weights(prox, behav, mask, "recompute")
    assert ones.tolist() == [[1.0, 1.0, 1.0, 0.0]] and none == {}
    dec, m = behaviour_weights(prox, behav, mask, "decoupled", cap=0)
    assert dec[0].tolist() == pytest.approx([1.0, 4.0, 3.0, 0.0], rel=1e-5)
    tis, m = behaviour_weights(prox, behav, mask, "tis", cap=2.0)
    assert tis[0].tolist() == pytest.approx([1.0, 2.0, 2.0, 0.0], rel=1e-5)
    assert m["is_capped_frac"] == pytest.approx(2 / 3) and m["is_weight_max"] == 2.0
    assert m["is_weight_mean"] == pytest.approx(5 / 3)
    # nothing off the mask leaks in, and the weights carry no gradient
    noisy = behav.clone()
    noisy[0, 3] = -1e3
    p = prox.clone().requires_grad_(True)
    again, _ = behaviour_weights(p, noisy, mask, "tis", cap=2.0)
    assert torch.equal(again, tis) and not again.requires_grad
    with pytest.raises(ValueError, match="valid: recompute, decoupled, tis"):
        behaviour_weights(prox, behav, mask, "vtrace")


def test_off_policy_correction_scales_the_policy_gradient(tiny_tokenizer, tiny_model):
    """Rollout logprobs equal to the model's give weight 1: every mode matches plain GRPO.
    Lowered by log 1.5 on every token, decoupled PPO's gradient is x1.5 and tis (cap 1.2)
    x1.2 (old logprobs reused: ratio 1, nothing clipped); recompute ignores them. The
    sequence modes: the geometric mean is 1.5 (x1.5 under cap 2 or inside [0.5, 2]), the
    product 1.5^n (cut to the cap; dropped by a mask whose upper bound is 1.4)."""
    import copy

    from agentgym.trainers.backends.base import batched_logprobs
    batch = _toy_batch(tiny_tokenizer)
    batch.old_logp = batch.ref_logp = None
    model = copy.deepcopy(tiny_model)
    batch.rollout_logp = batched_logprobs(model, batch, 1.0, 4096)[0] * batch.loss_mask
    _, base = _grads(model, batch, build_config({}), [list(range(8))])
    shifted = copy.deepcopy(batch)
    shifted.rollout_logp = batch.rollout_logp - math.log(1.5) * batch.loss_mask
    for mode, cap, factor in (("recompute", 2.0, 1.0), ("decoupled", 0.0, 1.5),
                              ("tis", 1.2, 1.2), ("geo_tis", 2.0, 1.5), ("seq_tis", 1.2, 1.2),
                              ("mis", 2.0, 1.5), ("geo_mis", 2.0, 1.5), ("geo_mis", 1.4, 0.0),
                              ("seq_mis", 1.4, 0.0)):
        # masks: cap is algo.is_high; a sequence ratio 1.5^n > 1.4 drops every row
        cfg = build_config({"algo.off_policy": mode, "algo.is_cap": cap, "algo.is_high": cap}
                           if cap > 1 else {"algo.off_policy": mode, "algo.is_cap": cap})
        _, same = _grads(model, batch, cfg, [list(range(8))])
        _, got = _grads(model, shifted, cfg, [list(range(8))])
        for k in base:
            tol = 1e-5 * float(base[k].abs().max())  # float noise of a summed gradient
            assert torch.allclose(same[k], base[k], rtol=1e-4, atol=tol), (mode, k)
            assert torch.allclose(got[k], base[k] * factor, rtol=1e-4, atol=tol), (mode, k)


def _update(model, batch, cfg, steps=2):
    """``steps`` calls of update_policy on a fresh AdamW backend (lr high enough that a
    step moves the weights); returns the backend and each call's metrics."""
    import copy

    from agentgym.trainers.backends.single import SingleBackend
    from agentgym.trainers.phases import update_policy
    from agentgym.trainers.hooks import Hooks
    backend = SingleBackend(copy.deepcopy(model), lr=1e-3)
    return backend, [update_policy(cfg, backend, batch, 1.0, s, Hooks()) for s in range(steps)]


def test_all_zero_advantages_skip_the_update_and_leave_adam_untouched(tiny_model, tiny_tokenizer):
    cfg = build_config({"trainer.mini_batches": 2})
    batch = _toy_batch(tiny_tokenizer)
    batch.adv = torch.zeros_like(batch.adv)
    backend, ms = _update(tiny_model, batch, cfg)
    assert [m["train/skipped_steps"] for m in ms] == [1.0, 1.0]
    assert ms[0]["train/skipped_tokens"] == float(batch.loss_mask.sum())
    for name, p in backend.model.state_dict().items():
        assert torch.equal(p, tiny_model.state_dict()[name]), name  # bit-identical weights
    assert backend.optimizer.state_dict()["state"] == {}  # no Adam moments, no step count
    assert backend.scheduler.last_epoch == 0
    # any other loss term makes every row count: the update runs
    for extra in ({"algo.entropy_coef": 0.01}, {"algo.kl_coef": 0.1}):
        _, ms = _update(tiny_model, batch, build_config({**extra}), steps=1)
        assert ms[0]["train/skipped_steps"] == 0.0 and ms[0]["train/skipped_tokens"] == 0.0


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_zero_advantage_rows_left_out_give_the_same_update(tiny_model, tiny_tokenizer,
                                                         policy_loss, monkeypatch):
    """Half the rows have all-zero advantages: leaving them out of the forward/backward
    gives the same weights and Adam state as training on every row."""
    from agentgym.trainers import phases
    batch = _toy_batch(tiny_tokenizer)
    batch.adv[:4] = 0.0  # group "0": rewards all equal
    cfg = build_config({"trainer.mini_batches": 2, "algo.policy_loss": policy_loss})
    trimmed, mt = _update(tiny_model, batch, cfg)
    monkeypatch.setattr(phases, "zero_gradient_rows", lambda cfg, b: None)  # no trimming
    full, mf = _update(tiny_model, batch, cfg)
    assert mt[0]["train/skipped_steps"] == 0.0
    assert mt[0]["train/skipped_tokens"] == float(batch.loss_mask[:4].sum())
    assert "train/skipped_tokens" not in mf[0] or mf[0]["train/skipped_tokens"] == 0.0
    for s in range(2):
        assert mt[s]["train/grad_norm"] == pytest.approx(mf[s]["train/grad_norm"], rel=1e-5)
    sd_t, sd_f = trimmed.model.state_dict(), full.model.state_dict()
    for name in sd_t:
        torch.testing.assert_close(sd_t[name], sd_f[name], atol=1e-6, rtol=1e-5)
    st_t, st_f = trimmed.optimizer.state_dict()["state"], full.optimizer.state_dict()["state"]
    assert st_t.keys() == st_f.keys()
    for k in st_t:
        for key in st_t[k]:
            torch.testing.assert_close(st_t[k][key], st_f[k][key], atol=1e-9, rtol=1e-5)


def test_rollout_correction_modes_by_hand():
    """Row 0: token ratios 1, 4, 3 (the fourth token is off the mask), so the sequence
    ratio is 12 (product) or 12^(1/3) = 2.289 (geometric mean); row 1: the rollout's
    logprobs equal the old ones (ratio 1 everywhere)."""
    from agentgym.trainers.algos import behaviour_weights
    prox = torch.log(torch.tensor([[0.5, 0.4, 0.9, 0.3], [0.2, 0.7, 0.6, 0.5]]))
    behav = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.9], [0.2, 0.7, 0.6, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    geo = 12 ** (1 / 3)

    def w(mode, **kw):
        weights, m = behaviour_weights(prox, behav, mask, mode, **kw)
        return [row[:3] for row in weights.tolist()], weights[0, 3].item(), m

    cases = {("seq_tis", 2.0): [2.0] * 3, ("seq_tis", 20.0): [12.0] * 3,
             ("geo_tis", 2.0): [2.0] * 3, ("geo_tis", 3.0): [geo] * 3,
             ("tis", 2.0): [1.0, 2.0, 2.0]}
    for (mode, cap), row0 in cases.items():
        rows, off, _ = w(mode, cap=cap)
        assert rows[0] == pytest.approx(row0, rel=1e-5), (mode, cap)
        assert rows[1] == pytest.approx([1.0] * 3) and off == 0.0
    masks = {("mis", 2.0): [1.0, 0.0, 0.0], ("mis", 5.0): [1.0, 4.0, 3.0],
             ("seq_mis", 2.0): [0.0] * 3, ("seq_mis", 20.0): [12.0] * 3,
             ("geo_mis", 2.0): [0.0] * 3, ("geo_mis", 3.0): [geo] * 3}
    for (mode, high), row0 in masks.items():
        rows, off, _ = w(mode, low=0.5, high=high)
        assert rows[0] == pytest.approx(row0, rel=1e-5), (mode, high)
        assert rows[1] == pytest.approx([1.0] * 3) and off == 0.0
    # the lower bound drops a ratio below it: row 0 reversed (ratios 1, 1/4, 1/3)
    weights, _ = behaviour_weights(behav, prox, mask, "mis", low=0.3, high=2.0)
    assert weights[0, :3].tolist() == pytest.approx([1.0, 0.0, 1 / 3], rel=1e-5)
    # metrics over the 7 sampled tokens: ratios 1, 4, 3 and four 1s
    _, _, m = w("seq_mis", low=0.5, high=2.0)
    assert m["is_masked_frac"] == pytest.approx(3 / 7)  # row 0's three tokens
    assert m["is_capped_frac"] == 0.0 and m["is_weight_max"] == pytest.approx(1.0)
    assert m["is_ratio_mean"] == pytest.approx(12 / 7) and m["is_ratio_max"] == pytest.approx(4)
    assert m["is_log_ratio_abs"] == pytest.approx((math.log(4) + math.log(3)) / 7)
    assert m["is_seq_log_ratio_abs"] == pytest.approx(3 * math.log(12) / 7)
    _, _, m = w("geo_tis", cap=2.0)
    assert m["is_capped_frac"] == pytest.approx(3 / 7) and m["is_masked_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx((3 * 2 + 4) / 7)
    assert m["is_seq_log_ratio_abs"] == pytest.approx(3 * math.log(geo) / 7)
    # no gradient, and a bad mode names the valid ones
    p = prox.clone().requires_grad_(True)
    assert not behaviour_weights(p, behav, mask, "seq_tis")[0].requires_grad
    with pytest.raises(ValueError, match="geo_mis"):
        behaviour_weights(prox, behav, mask, "vtrace")


def test_rollout_correction_config_is_checked():
    from agentgym.config import build_config
    with pytest.raises(ValueError, match="is_cap must be > 0 for algo.off_policy=seq_tis"):
        build_config({"algo.off_policy": "seq_tis", "algo.is_cap": 0})
    with pytest.raises(ValueError, match="is_low"):
        build_config({"algo.off_policy": "mis", "algo.is_low": 1.5})
    with pytest.raises(ValueError, match="valid: recompute, decoupled, tis, seq_tis"):
        build_config({"algo.off_policy": "truncate"})
