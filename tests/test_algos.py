"""Pure RL functions and their invariances (accumulation, masked positions)."""

from __future__ import annotations

import pytest
import torch

from agentgym.config import Config, build_config
from agentgym.types import Trajectory
from trainers.algos import (ADVANTAGES, POLICY_LOSSES, aggregate, grpo_advantages, gspo_loss,
                            kl_estimate, ppo_clip_loss, rloo_advantages)
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


def test_rloo_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 0.5, 1.5])
    adv = rloo_advantages(r, ["a", "a", "a", "a", "b", "c", "c"])
    # a: r_i minus the mean of the other three; b: alone, no baseline; c: pair
    want = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, -1.0, 1.0])
    torch.testing.assert_close(adv, want)
    ga = grpo_advantages(r[:4], ["a"] * 4, norm_by_std=False)  # n/(n-1) x Dr. GRPO
    torch.testing.assert_close(adv[:4], 4 / 3 * ga)
    assert ADVANTAGES.get("rloo") is rloo_advantages


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
    assert POLICY_LOSSES.get("gspo") is gspo_loss


def test_gspo_ignores_masked_positions_and_other_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    base = torch.tensor([[0.1, 0.3, 0.0], [-0.2, 0.0, 0.0]])
    noisy = base + torch.tensor([[0.0, 0.0, 5.0], [0.0, -3.0, 4.0]]) * (1 - mask)
    a, _ = gspo_loss(base, old, adv, mask, clip_low=0.2, clip_high=0.2)
    b, _ = gspo_loss(noisy, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0, :2], torch.tensor([-1.2, -1.2]))  # e^0.2 > 1.2: clipped
    torch.testing.assert_close(a[1, 0], torch.exp(torch.tensor(-0.2)))


def test_unknown_estimator_and_loss_list_valid_names():
    with pytest.raises(KeyError, match="rloo"):
        ADVANTAGES.get("rlooo")
    with pytest.raises(KeyError, match="gspo"):
        POLICY_LOSSES.get("gspoo")


def test_rloo_and_gspo_run_in_the_recipe(tmp_path):
    import json

    from agentgym.data import write_jsonl
    from toy_envs import letter_rows
    from trainers.grpo import train
    data = tmp_path / "toy.jsonl"
    write_jsonl(data, letter_rows(8))
    cfg = build_config({"env": "agentgym-test/Letter-v0", "model": "tiny", "data": str(data),
                        "trainer.total_steps": 2, "trainer.prompts_per_step": 2, "rollout.n": 4,
                        "rollout.max_tokens_per_turn": 8, "trainer.eval_limit": 0,
                        "algo.advantage": "rloo", "algo.policy_loss": "gspo",
                        "algo.loss_agg_mode": "seq-mean-token-mean", "algo.clip_low": 3e-4,
                        "algo.clip_high": 4e-4, "run_dir": str(tmp_path / "run")})
    run = train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["train/clipfrac"] <= 1.0 for r in rows)
    assert (run / "checkpoints" / "step_2" / "model.safetensors").exists()
