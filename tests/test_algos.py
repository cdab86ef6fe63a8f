"""The advantage estimators (trainers/algos.py): hand-computed values for every estimator,
loop-versus-vectorized equivalence, mask invariance, GAE bootstrapping on truncated vs
terminated episodes, masked whitening, DAPO's group filter and overlong penalty, and the
registries and algorithm presets. The policy losses are in tests/test_policy_losses.py,
the update built from them in tests/test_policy_update.py."""

from __future__ import annotations

import math

import pytest
import torch
from algo_inputs import random_multi_turn

from agentgym.config import ALGO_PRESETS, Config, build_config
from agentgym.trainers.algos import (ADVANTAGES, POLICY_LOSSES, compute_advantages,
                                     gae_advantages, grpo_advantages, groups_with_signal,
                                     masked_whiten, overlong_penalty, reinforce_pp_advantages,
                                     reinforce_pp_baseline_advantages, rloo_advantages)

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
    rewards, mask, values, last_values, truncated, groups = random_multi_turn(seed)
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
    rewards, mask, *_ = random_multi_turn(seed, B=12)
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
    rewards, mask, values, last_values, truncated, groups = random_multi_turn(5)
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


# --- whitening -------------------------------------------------------------------------------
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
