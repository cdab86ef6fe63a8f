"""The packed update (trainers/packing.py, trainers/attention.py, trainers/fused_head.py) against the padded one:
loss and every parameter's gradient equal, groups of 1 and 8, multi-turn masks with
observations, temperature, entropy and KL terms, LoRA, zero-advantage rows left out,
micro-batch splits, the varlen layout, and the balanced split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentgym.config import build_config
from agentgym.core.types import Trajectory
from agentgym.trainers import attention as at
from agentgym.trainers import balancing as bal
from agentgym.trainers import packing as pk
from agentgym.trainers.backends.base import token_logprobs
from agentgym.trainers.batch import Batch, collate
from agentgym.trainers.fused_head import head_logprobs, plain_logprobs
from agentgym.trainers.phases import make_loss_fn


def group_batch(tokenizer, groups: int, n: int, turns: int = 1, seed: int = 0,
                zero_adv_groups: int = 0) -> Batch:
    """``groups`` prompts x ``n`` samples; each sample's turns are a generated run then
    (between turns) an observation; lengths differ row to row, so the padded path pads."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda k: torch.randint(5, 300, (k,), generator=g).tolist()  # noqa: E731
    trajs = []
    for q in range(groups):
        prompt = rand(4 + 3 * q)
        for i in range(n):
            t = Trajectory(uid=f"q{q}", reward=float((i + q) % 3), sample_index=i)
            t.append("prompt", prompt, 0)
            for turn in range(turns):
                k = 2 + (i * 3 + turn) % 5
                t.append("generated", rand(k), turn, logprobs=[-1.0] * k)
                if turn < turns - 1:
                    t.append("observation", rand(3 + i % 2), turn)
            trajs.append(t)
    batch = collate(trajs, tokenizer.pad_token_id)
    mask = batch.loss_mask
    batch.rollout_logp = -torch.rand(mask.shape, generator=g) * mask
    batch.old_logp = -torch.rand(mask.shape, generator=g) * mask
    adv = torch.randn(len(trajs), generator=g)
    if zero_adv_groups:
        adv[:zero_adv_groups * n] = 0.0
    batch.adv = adv[:, None] * mask
    batch.ref_logp = -torch.rand(mask.shape, generator=g) * mask
    return batch


def loss_and_grads(model, batch: Batch, cfg, packing: bool, parts: list[list[int]] | None = None,
                   temperature: float = 1.0):
    """Summed loss of ``batch`` cut into ``parts`` (default: one micro-batch), gradients of
    every trainable parameter; the loss totals are the whole batch's."""
    model.zero_grad(set_to_none=True)
    fn = make_loss_fn(cfg, temperature, float(batch.loss_mask.sum()), len(batch),
                      cfg.rollout.max_response_tokens)
    fn = dataclasses.replace(fn, packing=packing)
    total = 0.0
    for rows in parts or [list(range(len(batch)))]:
        loss, _ = fn(model, batch.select(rows))
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return total, grads


def assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert la == pytest.approx(lb, abs=1e-6)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-5, atol=1e-6, msg=name)


CFG = {"algo": "grpo", "algo.kl_coef": 0.05, "algo.kl_mode": "loss", "algo.entropy_coef": 0.01}


@pytest.mark.parametrize("groups,n,turns", [(3, 1, 1), (2, 8, 1), (2, 4, 3)])
def test_packed_loss_and_gradients_equal_the_padded_pass(tiny_path, tiny_tokenizer, groups, n,
                                                         turns):
    from agentgym.models.zoo import load_model
    model = load_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, groups, n, turns)
    cfg = build_config(CFG)
    padded = loss_and_grads(model, batch, cfg, packing=False, temperature=0.7)
    packed = loss_and_grads(model, batch, cfg, packing=True, temperature=0.7)
    assert model.config._attn_implementation == "agentgym_packed_sdpa"
    assert_same(padded, packed)


def test_a_group_prompt_is_packed_once(tiny_tokenizer):
    batch = group_batch(tiny_tokenizer, 2, 8, turns=2)
    lengths = batch.attention_mask.sum(-1).tolist()
    pack = pk.build_pack(batch.input_ids, lengths, batch.loss_mask, groups=batch.uids)
    alone = pk.build_pack(batch.input_ids, lengths, batch.loss_mask)
    prompts = [4, 7]
    # each group's rows share at least their prompt; only the first copy is packed
    assert pack.shared >= sum(p * 7 for p in prompts)
    assert pack.input_ids.shape[1] == alone.input_ids.shape[1] - pack.shared
    # nothing past the last sampled token, no padding
    assert alone.input_ids.shape[1] < int(batch.attention_mask.sum())
    assert len(pack.hidden_at) == int(batch.loss_mask[:, 1:].sum())


def test_split_into_micro_batches_keeps_the_gradient(tiny_path, tiny_tokenizer):
    from agentgym.models.zoo import load_model
    model = load_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, 3, 4, turns=2, seed=1)
    cfg = build_config(CFG)
    whole = loss_and_grads(model, batch, cfg, packing=True)
    parts = bal.split_rows(batch.input_ids, batch.attention_mask.sum(-1).tolist(), batch.uids,
                          max_tokens=40)
    assert len(parts) > 1 and sorted(sum(parts, [])) == list(range(len(batch)))
    split = loss_and_grads(model, batch, cfg, packing=True, parts=parts)
    # a split that cuts a group in two (its prefix packed twice) changes nothing either
    cut = loss_and_grads(model, batch, cfg, packing=True, parts=[[0, 1, 5], [2, 3, 4],
                                                                  list(range(6, 12))])
    assert_same(whole, split)
    assert_same(whole, cut)


def test_lora_gradients_equal(tiny_path, tiny_tokenizer):
    from agentgym.models.zoo import load_model
    from agentgym.trainers.lora import LoraSpec, wrap
    model = wrap(load_model(tiny_path), LoraSpec(rank=4, alpha=8, dropout=0.0, seed=0)).train()
    with torch.no_grad():  # adapters start at B = 0; give them a gradient path both ways
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    batch = group_batch(tiny_tokenizer, 2, 8, turns=2, seed=2)
    cfg = build_config(CFG)
    padded = loss_and_grads(model, batch, cfg, packing=False)
    packed = loss_and_grads(model, batch, cfg, packing=True)
    assert padded[1] and all("lora" in n for n in padded[1])
    assert_same(padded, packed)


def test_zero_advantage_rows_left_out_keep_the_gradient(tiny_path, tiny_tokenizer):
    """The recipe drops zero-advantage rows (phases.zero_gradient_rows) with the loss's
    totals kept: packed without them equals padded with them."""
    from agentgym.models.zoo import load_model
    model = load_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, 3, 4, seed=3, zero_adv_groups=1)
    cfg = build_config({"algo": "grpo"})
    padded = loss_and_grads(model, batch, cfg, packing=False)
    kept = [i for i in range(len(batch)) if bool((batch.adv[i] != 0).any())]
    assert len(kept) == 8
    packed = loss_and_grads(model, batch, cfg, packing=True, parts=[kept])
    assert_same(padded, packed)


def test_logprobs_without_grad_equal(tiny_path, tiny_tokenizer):
    from agentgym.models.zoo import load_model
    from agentgym.trainers.backends.base import sequence_logprobs
    model = load_model(tiny_path)
    batch = group_batch(tiny_tokenizer, 2, 8, turns=2, seed=4)
    with torch.no_grad():
        lp, ent = token_logprobs(model, batch, torch.device("cpu"), 0.7, with_entropy=True)
        ref, ref_ent = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 0.7,
                                         with_entropy=True)
    m = batch.loss_mask > 0
    m[:, 0] = False
    torch.testing.assert_close(lp[m], ref[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m], rtol=1e-5, atol=1e-5)
    assert float(lp[~m].abs().sum()) == 0.0


def test_varlen_layout_equals_the_dense_one(tiny_path, tiny_tokenizer):
    """The layout a GPU's flash_attn_varlen_func gets, through its CPU stand-in."""
    from agentgym.models.zoo import load_model
    model = load_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, 2, 4, turns=2, seed=5)
    cfg = build_config(CFG)
    dense = loss_and_grads(model, batch, cfg, packing=True)
    at.use_varlen(at.varlen_standin)
    try:
        varlen = loss_and_grads(model, batch, cfg, packing=True)
    finally:
        at.use_varlen(None)
    assert_same(dense, varlen)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_head_equals_autograd(with_entropy):
    """Log-probs, entropies and both gradients equal autograd's over the full logits, with
    every chunk kept, none kept (recomputed in the scratch blocks) and some of each, a last
    chunk shorter than the others, at temperatures 1 and not."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    wl, we = torch.randn(37, generator=g), torch.randn(37, generator=g)
    for temperature, keep in ((1.0, 1 << 30), (0.6, 0), (1.3, 3000), (1.0, 3000)):
        lp, ent = head_logprobs(head, h, t, temperature, with_entropy=with_entropy,
                                entropy_grad=True, chunk=8, keep_bytes=keep)
        lp2, ent2 = plain_logprobs(head(h), t, temperature, with_entropy=with_entropy)
        objective = [(lp * wl).sum(), (lp2 * wl).sum()]
        if with_entropy:
            torch.testing.assert_close(ent, ent2)
            objective = [objective[0] + (ent * we).sum(), objective[1] + (ent2 * we).sum()]
        else:
            assert ent is None and ent2 is None
        gh, gw = torch.autograd.grad(objective[0], [h, head.weight])
        gh2, gw2 = torch.autograd.grad(objective[1], [h, head.weight])
        torch.testing.assert_close(lp, lp2)
        torch.testing.assert_close(gh, gh2)
        torch.testing.assert_close(gw, gw2)


def test_fused_head_under_bf16_autocast_is_as_close_to_fp32_as_the_unfused_head():
    """Under autocast the fused head's matmuls run in bf16 (cast explicitly, autocast off
    inside) and the rest in fp32, as the unfused head under autocast does: its values and
    gradients are as far from fp32's as the unfused head's (bf16 rounding, ~1e-2 here)."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 80, bias=False)
    h = torch.randn(21, 32, requires_grad=True)
    t = torch.randint(0, 80, (21,))
    wl = torch.randn(21)

    def run(fused: bool, bf16: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp = (head_logprobs(head, h, t, chunk=8) if fused
                  else plain_logprobs(head(h), t, 1.0, with_entropy=False))[0]
        return (lp.detach(), *torch.autograd.grad((lp * wl).sum(), [h, head.weight]))

    exact = run(fused=False, bf16=False)
    fused, unfused = run(fused=True, bf16=True), run(fused=False, bf16=True)
    for name, f, u, x in zip(("logp", "d hidden", "d weight"), fused, unfused, exact):
        assert f.dtype == torch.float32, name
        assert 0 < float((u - x).abs().max()), name  # bf16 did round the unfused head
        assert float((f - x).abs().max()) <= 2 * float((u - x).abs().max()), name


def test_a_packed_forward_makes_no_attention_mask(tiny_path):
    """transformers would build a (T, T) block-causal mask from a pack's restarted
    positions, which the packed attention never reads: inside ``packed_forward`` the
    model's mask comes back None; outside it (an unpacked forward through the same
    attention name) transformers builds it as before."""
    from transformers.masking_utils import create_causal_mask

    from agentgym.trainers.backends.base import ModelSpec
    model = ModelSpec(str(tiny_path)).load("cpu")
    assert at.enable(model)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])  # two segments in one row
    embeds = torch.zeros(1, 7, model.config.hidden_size)

    def mask():
        return create_causal_mask(config=model.config, inputs_embeds=embeds,
                                  attention_mask=None, past_key_values=None,
                                  position_ids=positions)
    with at.packed_forward():
        assert mask() is None
    outside = mask()
    assert outside is not None and not bool(outside[0, 0, 4, 3])  # the segments kept apart


def test_karmarkar_karp_balances():
    costs = [90, 70, 60, 50, 40, 30, 20, 10, 5, 5]
    parts = bal.karmarkar_karp(costs, 3)
    assert sorted(sum(parts, [])) == list(range(10))
    sums = [sum(costs[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= 10


def test_split_rows_gives_every_rank_work(tiny_tokenizer):
    """A mini-batch that fits one micro-batch still goes to every rank, in near-equal
    token shares, a group never cut when it fits."""
    batch = group_batch(tiny_tokenizer, 4, 4, turns=2, seed=6)
    lengths = batch.attention_mask.sum(-1).tolist()
    parts = bal.split_rows(batch.input_ids, lengths, batch.uids, 10_000, multiple=2)
    assert len(parts) == 2
    for p in parts:
        assert len({batch.uids[i] for i in p}) == 2
        assert all(sum(1 for i in p if batch.uids[i] == u) == 4 for u in {batch.uids[i] for i in p})


def test_dummy_pass_keeps_a_graph(tiny_path, tiny_tokenizer):
    """A micro-batch with nothing sampled (a rank's dummy) still backpropagates."""
    from agentgym.models.zoo import load_model
    from agentgym.trainers.backends.distributed import dummy_like
    model = load_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, 1, 2)
    dummy = dummy_like(batch)
    lp, _ = token_logprobs(model, dummy, torch.device("cpu"))
    assert float(lp.detach().abs().sum()) == 0.0 and lp.requires_grad
    lp.sum().backward()


def test_critic_values_and_gradients_equal(tiny_path, tiny_tokenizer):
    """The critic's packed pass: values at the sampled tokens and each row's last state,
    and the value loss's gradients, as the padded pass gives them."""
    from agentgym.models.zoo import load_value_model
    from agentgym.trainers.critic import ValueLoss, token_values
    model = load_value_model(tiny_path).train()
    batch = group_batch(tiny_tokenizer, 2, 4, turns=2, seed=7)
    cpu = torch.device("cpu")
    with torch.no_grad():
        v0, last0 = token_values(model, batch, cpu, packing=False)
        v1, last1 = token_values(model, batch, cpu, packing=True, whole=True)
    m = batch.loss_mask > 0
    torch.testing.assert_close(v1[m], v0[m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last1, last0, rtol=1e-5, atol=1e-6)
    batch.values, batch.returns = v0.detach() * m, torch.randn(v0.shape) * m
    grads = []
    for packing in (False, True):
        model.zero_grad(set_to_none=True)
        loss, _ = ValueLoss(0.2, "token-mean", float(m.sum()), len(batch), 64, packing)(model, batch)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_and_bf16(tiny_path, tiny_tokenizer):
    """The pack reaches every layer when the backward recomputes it (activation
    checkpointing), and bf16 autocast runs the packed path close to the padded one."""
    from agentgym.trainers.backends.base import ModelSpec
    spec = ModelSpec(str(tiny_path), gradient_checkpointing=True)
    model = spec.load("cpu").train()
    batch = group_batch(tiny_tokenizer, 2, 4, turns=2, seed=8)
    cfg = build_config(CFG)
    assert_same(loss_and_grads(model, batch, cfg, packing=False),
                loss_and_grads(model, batch, cfg, packing=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = loss_and_grads(model, batch, cfg, packing=False)
        b = loss_and_grads(model, batch, cfg, packing=True)
    assert a[0] == pytest.approx(b[0], rel=0.05, abs=1e-3)
    for name in a[1]:
        cos = torch.nn.functional.cosine_similarity(a[1][name].flatten(), b[1][name].flatten(), 0)
        assert float(cos) > 0.98, name


def test_vision_rows_project_only_the_sampled_positions():
    """A vision-language model is not packed (its 3-D positions are laid out per padded
    row), but its update still projects only the sampled positions: the same logprobs and
    gradients as the padded pass."""
    from agentgym.envs.geometry import BUILTIN_ROWS, load_image
    from agentgym.models.zoo import load_model, load_tokenizer, resolve_model
    from agentgym.rollout.chat import ChatTokens
    from agentgym.trainers.backends.base import sequence_logprobs
    path = resolve_model("tiny-vl")
    model, tok = load_model(path).train(), load_tokenizer(path)
    chat = ChatTokens(tok)
    rows, images = [], []
    for i, r in enumerate(BUILTIN_ROWS[:2]):
        ids, vision = chat.prompt([{"role": "user", "content": [
            {"type": "image", "image": load_image(r["images"][0])},
            {"type": "text", "text": "Find x."}]}])
        rows.append(ids + list(range(40, 46 + 3 * i)))
        images.append(vision)
    T = max(map(len, rows))
    ids = torch.full((2, T), tok.pad_token_id)
    attn = torch.zeros((2, T), dtype=torch.long)
    mask = torch.zeros((2, T))
    for i, r in enumerate(rows):
        ids[i, :len(r)], attn[i, :len(r)] = torch.tensor(r), 1
        mask[i, len(r) - 6 - 3 * i:len(r)] = 1
    zeros = torch.zeros((2, T))
    batch = Batch(ids, attn, mask, zeros, torch.zeros(2), ["a", "b"], zeros, torch.zeros(2),
                  images=images)
    lp, _ = token_logprobs(model, batch, torch.device("cpu"), 0.8)
    ref, _ = sequence_logprobs(model, ids, attn, 0.8, images=images)
    m = mask > 0
    torch.testing.assert_close(lp[m], ref[m], rtol=1e-5, atol=1e-5)
    w = torch.randn(2, T)
    g1 = torch.autograd.grad((lp * w * mask).sum(), list(model.parameters()), allow_unused=True)
    g2 = torch.autograd.grad((ref * w * mask).sum(), list(model.parameters()), allow_unused=True)
    for a, b in zip(g1, g2):
        if a is None or b is None:
            assert a is None and b is None or float((a if a is not None else b).abs().sum()) == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_an_sft_batch_shares_its_common_prefix_exactly(tiny_path, tiny_tokenizer):
    """SFT packs a batch as one group (trainers/sft.py, ``SHARED``): sequences of different
    prompts that begin alike (a system turn, an env's instructions) encode that beginning
    once, and the NLL and every gradient equal the padded pass's; ``shared_tokens`` counts
    what was not encoded again."""
    from agentgym.models.zoo import load_model
    from agentgym.trainers.sft import SHARED, sft_loss_fn
    g = torch.Generator().manual_seed(3)
    rand = lambda k: torch.randint(5, 300, (k,), generator=g).tolist()  # noqa: E731
    instructions = rand(9)
    trajs = []
    for i in range(5):
        t = Trajectory(uid=f"demo{i}")
        t.append("prompt", instructions + rand(3 + i), 0)  # the question differs
        t.append("generated", rand(4 + i % 3), 0, logprobs=[0.0] * (4 + i % 3))
        t.append("observation", rand(6), 0)
        t.append("generated", rand(3), 1, logprobs=[0.0] * 3)
        trajs.append(t)
    batch = collate(trajs, tiny_tokenizer.pad_token_id)
    lengths = batch.attention_mask.sum(-1).tolist()
    assert pk.shared_tokens(batch.input_ids, lengths, batch.uids) == 0  # own uids: no group
    batch.uids = [f"{SHARED}/0"] * len(batch)  # one process: one group
    shared = pk.shared_tokens(batch.input_ids, lengths, batch.uids)
    assert shared >= 9 * 4
    pack = pk.build_pack(batch.input_ids, lengths, batch.loss_mask, groups=batch.uids)
    assert pack.shared == shared

    model = load_model(tiny_path).train()
    n = float(batch.loss_mask.sum())

    def run(packing: bool):
        model.zero_grad(set_to_none=True)
        loss, _ = sft_loss_fn(n, 0, packing)(model, batch)
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}

    assert_same(run(False), run(True))
