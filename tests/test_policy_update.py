"""The policy loss inside the recipe (trainers/phases.py, trainers/batch.py) on the tiny
model: micro-batching and collation, gradient accumulation invariances, values at masked
positions, reused logprobs, the off-policy correction's effect on the gradient, and the
skipped update of all-zero advantages."""

from __future__ import annotations

import math

import pytest
import torch

from agentgym.config import build_config
from agentgym.core.types import Trajectory
from agentgym.trainers.balancing import micro_batches
from agentgym.trainers.batch import collate
from agentgym.trainers.phases import make_loss_fn


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
