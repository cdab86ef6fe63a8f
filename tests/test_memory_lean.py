"""Memory-lean updates: chunked log-probabilities (trainer.logprob_chunk) and activation
checkpointing (model.gradient_checkpointing) give the plain computation's values and
gradients."""

from __future__ import annotations

import pytest
import torch

from agentgym.trainers.backends.base import ModelSpec, _decoder_and_head, sequence_logprobs


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 23), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 17:] = 0  # right padding, as collate makes it
    attn[2, 9:] = 0
    ids[attn == 0] = 0
    return ids, attn


def _loss_and_grads(model, ids, attn, chunk: int, start: int):
    model.zero_grad(set_to_none=True)
    logp, ent = sequence_logprobs(model, ids, attn, temperature=0.7, with_entropy=True,
                                  start=start, entropy_grad=True, chunk=chunk)
    mask = attn.float()
    loss = -(logp * mask).sum() / mask.sum() - 0.1 * (ent * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])  # 1 row, uneven, a few, all in one
@pytest.mark.parametrize("start", [0, 5])
def test_chunked_logprobs_equal_plain_values_and_gradients(tiny_path, chunk, start):
    model = ModelSpec(str(tiny_path)).load().train()  # its own copy: grads get written
    assert _decoder_and_head(model) is not None  # the chunked path is the one taken
    ids, attn = _batch(model.config.vocab_size)
    lp0, ent0, g0 = _loss_and_grads(model, ids, attn, chunk=0, start=start)
    lp1, ent1, g1 = _loss_and_grads(model, ids, attn, chunk=chunk, start=start)
    assert lp0.abs().sum() > 0 and len(g0) == len(list(model.parameters()))
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_logprobs_without_grad_and_under_bf16_autocast(tiny_model):
    model = tiny_model
    ids, attn = _batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        plain, _ = sequence_logprobs(model, ids, attn, start=4)
        chunked, _ = sequence_logprobs(model, ids, attn, start=4, chunk=10)
        assert not chunked.requires_grad
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_bf, _ = sequence_logprobs(model, ids, attn, start=4)
            chunked_bf, _ = sequence_logprobs(model, ids, attn, start=4, chunk=10)
    assert (plain_bf - plain).abs().max() > 0  # autocast is on in both ...
    torch.testing.assert_close(chunked_bf, plain_bf, rtol=0, atol=2e-2)  # ... bf16 head in both


def test_chunked_logprobs_through_lora(tiny_path):
    from agentgym.trainers.lora import LoraSpec
    model = ModelSpec(str(tiny_path), lora=LoraSpec(4, 8.0)).load().train()
    with torch.no_grad():  # non-zero adapters, so LoRA changes the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert _decoder_and_head(model) is not None
    ids, attn = _batch(model.config.vocab_size, seed=2)
    lp0, _, g0 = _loss_and_grads(model, ids, attn, chunk=0, start=2)
    lp1, _, g1 = _loss_and_grads(model, ids, attn, chunk=6, start=2)
    assert g0 and all("lora_" in n for n in g0)  # only the adapters train
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_path):
    plain = ModelSpec(str(tiny_path)).load().train()
    ckpt = ModelSpec(str(tiny_path), gradient_checkpointing=True).load().train()
    on = [getattr(m, "is_activation_checkpointing", None) for m in (plain, ckpt)]
    if on == [None, None]:  # transformers before the rename
        on = [m.is_gradient_checkpointing for m in (plain, ckpt)]
    assert on == [False, True]
    ids, attn = _batch(plain.config.vocab_size, seed=3)
    lp0, _, g0 = _loss_and_grads(plain, ids, attn, chunk=0, start=1)
    lp1, _, g1 = _loss_and_grads(ckpt, ids, attn, chunk=16, start=1)  # both memory savers
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    assert g1.keys() == g0.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
