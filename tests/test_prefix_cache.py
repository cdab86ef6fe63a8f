"""Prefix cache and continuous batching: the radix tree by hand, then the engine with the
cache on against the engine with it off (same seeds: same tokens, same logprobs), under a
budget small enough to evict, with requests joining a running decode, and with a long
prompt prefilled in chunks between decode steps."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from test_engine import trainer_logprobs
from toy_envs import TalkEnv

from agentgym.config import RolloutConfig
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.prefix_cache import PrefixCache
from agentgym.rollout.manager import GenerationManager
from agentgym.core.types import SamplingParams


def kv_of(ids):
    """Fake keys/values whose every position carries its own token id (layers=2, heads=1,
    head_dim=1): what the tree returns can be checked against the ids."""
    def source(a, b):
        x = torch.tensor(ids[a:b], dtype=torch.float32)[None, None, :, None]
        return torch.stack([torch.cat([x, -x])] * 2)  # (2 layers, 2, 1, b - a, 1)
    return source


def ids_in(kv):
    return kv[0, 0, 0, :, 0].long().tolist()


# -- the radix tree ------------------------------------------------------------------------
def test_radix_tree_stores_each_prefix_once_and_finds_the_longest():
    cache = PrefixCache(max_tokens=100)
    a = [1, 2, 3, 4, 5]
    assert cache.insert(a, kv_of(a)) == 5
    b = [1, 2, 3, 9, 9, 9]  # splits a's edge after 3 tokens; only the new tail is stored
    assert cache.insert(b, kv_of(b)) == 3
    assert cache.tokens == 8
    assert cache.insert(a, kv_of(a)) == 0  # already there
    for query, want in (([1, 2, 3, 4, 5, 6], a), ([1, 2, 3, 9, 9, 7], [1, 2, 3, 9, 9]),
                        ([1, 2, 7], [1, 2]), ([7, 1], []), (b, b)):
        path = cache.match(query)
        assert PrefixCache.length(path) == len(want)
        kv = PrefixCache.gather(path)
        assert (kv is None) == (not want)
        if want:
            assert ids_in(kv) == want and kv.shape == (2, 2, 1, len(want), 1)
            assert (kv[:, 1] == -kv[:, 0]).all()  # values belong to their keys
    assert PrefixCache.length(cache.match(a + [6], limit=3)) == 3
    cache.clear()
    assert cache.tokens == 0 and cache.match(a) == []


def test_radix_tree_evicts_least_recently_used_leaves_within_budget():
    cache = PrefixCache(max_tokens=10)
    old, mid = [1, 2, 3, 4], [1, 2, 5, 6]
    cache.insert(old, kv_of(old))
    cache.insert(mid, kv_of(mid))  # shares [1, 2]: 6 positions in all
    cache.match(old)  # old is now more recently used than mid
    new = [7, 8, 9, 10, 11]
    cache.insert(new, kv_of(new))  # 11 > 10: the least recently used leaf (mid's tail) goes
    assert cache.tokens == 9 and cache.stats["evicted_tokens"] == 2
    assert PrefixCache.length(cache.match(mid)) == 2  # its shared prefix stays
    assert PrefixCache.length(cache.match(old)) == 4
    assert PrefixCache.length(cache.match(new)) == 5
    huge = list(range(100, 120))  # alone over budget: it cannot stay, the tree stays valid
    cache.insert(huge, kv_of(huge))
    assert cache.tokens <= 10
    for seq in (old, new):
        path = cache.match(seq)
        if path:
            assert ids_in(PrefixCache.gather(path)) == seq[:PrefixCache.length(path)]
    with pytest.raises(ValueError, match="cache_tokens"):
        PrefixCache(0)


# -- the engine ----------------------------------------------------------------------------
def talk_rollouts(engine, tok, rows=2, n=3, turns=3):
    """A multi-turn group rollout: ``rows`` prompts x ``n`` samples, ``turns`` turns each."""
    cfg = RolloutConfig(n=n, max_turns=turns, max_tokens_per_turn=8, temperature=1.0)
    mgr = GenerationManager(engine, tok, lambda: TalkEnv(max_turns=turns), cfg, seed=3)
    data = [{"prompt": [{"role": "user", "content": f"Talk #{i}, please."}],
             "extra_info": {"index": i}} for i in range(rows)]

    async def go():
        return await asyncio.gather(*(mgr.play_one(row, uid=str(i), sample_index=k)
                                      for i, row in enumerate(data) for k in range(n)))
    try:
        return asyncio.run(go())
    finally:
        mgr.close()


def same_trajectories(a, b):
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


@pytest.mark.parametrize("budget", [65536, 24])
def test_cache_on_equals_cache_off_over_multi_turn_rollouts(tiny_model, tiny_tokenizer, budget):
    """Same seeds, same tokens and logprobs; with the cache on, later turns prefill only
    their new tokens. A 24-position budget evicts all the time and stays exact."""
    off = HFEngine(tiny_model, tiny_tokenizer, continuous_batching=False, prefix_cache=False)
    on = HFEngine(tiny_model, tiny_tokenizer, cache_tokens=budget)
    try:
        base, cached = talk_rollouts(off, tiny_tokenizer), talk_rollouts(on, tiny_tokenizer)
    finally:
        off.close()
        on.close()
    same_trajectories(base, cached)
    assert all(len([s for s in t.segments if s.kind == "generated"]) == 3 for t in cached)
    for t in cached:  # and they are what a trainer computes over the whole trajectory
        mask = torch.tensor(t.loss_mask[1:]) > 0
        ref = torch.tensor(trainer_logprobs(tiny_model, t.token_ids, 1, 1.0))
        assert (ref[mask] - torch.tensor(t.logprobs[1:])[mask]).abs().max() < 1e-4
    s = on.stats
    assert s["cached_tokens"] > 0 and s["requests"] == 18
    assert s["prefilled_tokens"] + s["cached_tokens"] == off.stats["prefilled_tokens"]
    if budget == 24:
        assert on.prefix.stats["evicted_tokens"] > 0 and on.prefix.tokens <= 24
    else:  # every turn after the first reuses its own history: mostly cache
        assert s["cached_tokens"] > 2 * s["prefilled_tokens"]


def test_group_samples_share_one_prefill(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("One prompt, four samples of it.")
    sp = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s) for s in range(4)]

    async def go():
        return await asyncio.gather(*(engine.generate(prompt, p) for p in sp))
    try:
        outs = asyncio.run(go())
    finally:
        engine.close()
    assert len({tuple(o.ids) for o in outs}) > 1  # four different samples
    # one prefill, then at most the last prompt token again per sample (when a sample
    # arrived after the prompt was done, it reuses all but the token that gives logits)
    assert engine.stats["prefilled_tokens"] <= len(prompt) + 3


class Hold:
    """Fault injection: the model's ``at``-th forward pass (1-based) waits until the test
    releases it; every forward's input width is recorded."""

    def __init__(self, model, at: int):
        self.at, self.calls, self.widths = at, 0, []
        self.inside, self.release = threading.Event(), threading.Event()
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.widths.append((ids.shape[0], ids.shape[1]))
        if self.calls == self.at:
            self.inside.set()
            assert self.release.wait(timeout=120)


async def queued(engine, n: int):
    """Wait until ``n`` requests wait in the engine's queue (a condition, 120 s at most)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while engine.waiting() < n:
        assert loop.time() < deadline, "requests never reached the engine"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_requests_joining_mid_decode_get_what_they_get_alone(tiny_model, tiny_tokenizer,
                                                           prefix_cache):
    import copy
    model = copy.deepcopy(tiny_model)
    tok = tiny_tokenizer
    long_prompt, others = tok.encode("A long answer:"), [tok.encode(p) for p in ("b c", "d")]
    sp = SamplingParams(max_new_tokens=30, temperature=1.0, seed=11, stop=("\x00never",))
    short = SamplingParams(max_new_tokens=10, temperature=0.8, seed=12)

    def alone(prompt, p):
        e = HFEngine(model, tok, prefix_cache=prefix_cache)
        try:
            return asyncio.run(e.generate(prompt, p))
        finally:
            e.close()
    want = [alone(long_prompt, sp)] + [alone(p, short) for p in others]

    engine = HFEngine(model, tok, prefix_cache=prefix_cache)
    hold = Hold(model, at=6)  # the long request's prefill, then its 5th decode step

    async def go():
        first = asyncio.ensure_future(engine.generate(long_prompt, sp))
        assert await asyncio.to_thread(hold.inside.wait, 120)
        later = [asyncio.ensure_future(engine.generate(p, short)) for p in others]
        await queued(engine, 2)
        hold.release.set()
        return [await first] + [await f for f in later]
    try:
        got = asyncio.run(go())
    finally:
        hold.handle.remove()
        engine.close()
    for g, w in zip(got, want):
        assert g.ids == w.ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert len(got[0].ids) == 30
    assert engine.stats["max_rows"] == 3  # they decoded beside the long one
    assert hold.widths[:6] == [(1, len(long_prompt))] + [(1, 1)] * 5


def test_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny_model, tiny_tokenizer):
    import copy
    model = copy.deepcopy(tiny_model)
    tok = tiny_tokenizer
    decoding = tok.encode("x")
    long_prompt = tok.encode(" ".join(f"word{i}" for i in range(12)))
    assert len(long_prompt) > 12
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, seed=1, stop=("\x00never",))
    engine = HFEngine(model, tok, prefill_chunk=4)
    hold = Hold(model, at=3)

    async def go():
        first = asyncio.ensure_future(engine.generate(decoding, sp))
        assert await asyncio.to_thread(hold.inside.wait, 120)
        second = asyncio.ensure_future(
            engine.generate(long_prompt, SamplingParams(max_new_tokens=3, temperature=0)))
        await queued(engine, 1)
        hold.release.set()
        return await first, await second
    try:
        a, b = asyncio.run(go())
    finally:
        hold.handle.remove()
        engine.close()
    # after the held step: a 4-token chunk of the long prompt, a decode step, and so on
    chunks = -(-len(long_prompt) // 4)
    after = hold.widths[3:3 + 2 * chunks]
    assert after[0::2] == [(1, min(4, len(long_prompt) - 4 * k)) for k in range(chunks)]
    assert after[1::2] == [(1, 1)] * (chunks - 1) + [(2, 1)]  # the prompt's row joined last
    for prompt, out in ((decoding, a), (long_prompt, b)):
        ref = trainer_logprobs(model, prompt + out.ids, len(prompt), 1.0)
        assert out.logprobs == pytest.approx(ref, abs=1e-4)


def test_flush_cache_empties_the_tree_when_idle(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("flush me")
    sp = SamplingParams(max_new_tokens=4, temperature=0)
    try:
        asyncio.run(engine.generate(prompt, sp))
        assert engine.prefix.tokens > 0
        assert engine.flush_cache() is True
        assert engine.prefix.tokens == 0
        asyncio.run(engine.generate(prompt, sp))
        assert engine.stats["cached_tokens"] == 0  # nothing left to reuse
    finally:
        engine.close()
