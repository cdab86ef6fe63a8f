"""The policy and value losses (trainers/algos.py): PPO-clip, dual-clip, clip-higher and
GSPO by hand, the value loss, loss aggregation modes, the KL estimators, the off-policy
(rollout correction) weights, and that nothing at a masked position changes a loss or its
gradient."""

from __future__ import annotations

import math

import pytest
import torch
from algo_inputs import random_multi_turn

from agentgym.trainers.algos import (aggregate, compute_policy_loss, dual_clip_loss, gspo_loss,
                                     kl_estimate, ppo_clip_loss, value_loss)


# --- mask invariance -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo"])
def test_policy_losses_ignore_everything_at_mask_zero(name):
    _, mask, *_ = random_multi_turn(3)
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


# --- aggregation, KL --------------------------------------------------------------------------
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


# --- off-policy (rollout correction) weights ----------------------------------------------
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
