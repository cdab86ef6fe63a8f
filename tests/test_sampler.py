"""The batched sampler (agentgym.rollout.engines.sampler): the distributions it draws
from, counter-based seeds, and a request's tokens whoever shares its batch."""

import asyncio

import pytest
import torch

from agentgym.core.types import SamplingParams
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.sampler import RowParams, sample, uniforms
from test_engine import generate_together

P = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
CASES = [(SamplingParams(temperature=1.0), P),
         (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0.625, 0.375, 0, 0, 0])),
         (SamplingParams(temperature=1.0, top_p=0.9),
          torch.tensor([0.5, 0.3, 0.15, 0, 0]) / 0.95),
         (SamplingParams(temperature=0.0), torch.tensor([1.0, 0, 0, 0, 0]))]


def test_uniforms_are_in_the_open_interval_and_spread_evenly():
    seeds = torch.arange(100_000, dtype=torch.long) * 7919 - 12345
    u = uniforms(seeds, torch.zeros_like(seeds))
    assert (u > 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert ((counts - 10_000).abs() < 4 * 95).all(), counts  # 4 standard errors
    # the same (seed, position) gives the same draw; a step further, another one
    assert torch.equal(u, uniforms(seeds, torch.zeros_like(seeds)))
    assert (u != uniforms(seeds, torch.ones_like(seeds))).float().mean() > 0.99


@pytest.mark.parametrize("mixed", [False, True])
def test_sampler_draws_from_the_truncated_distribution(mixed):
    """Frequencies of 40,000 draws (distinct seeds) per case, 4 standard errors of
    tolerance; ``mixed``: every case's rows in one batch, so each row's cut is its own."""
    n = 40_000
    logits = P.clamp(min=1e-12).log()
    groups = [CASES] if mixed else [[c] for c in CASES]
    for cases in groups:
        settings = [sp for sp, _ in cases for _ in range(n)]
        rows = RowParams.build(settings, list(range(len(settings))), [3] * len(settings), 5,
                               "cpu")
        tokens, logps, _ = sample(logits.expand(len(settings), 5).clone(), rows)
        for i, (sp, want) in enumerate(cases):
            part = tokens[i * n:(i + 1) * n]
            freq = torch.bincount(part, minlength=5).float() / n
            tol = 4 * (want * (1 - want) / n).sqrt() + 1e-9
            assert ((freq - want).abs() <= tol).all(), (sp, freq, want)
        torch.testing.assert_close(logps, logits.log_softmax(-1)[tokens])  # untruncated


def test_top_logprobs_are_the_likeliest_of_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    rows = RowParams.build([SamplingParams(temperature=0.5, top_logprobs=2),
                            SamplingParams(temperature=0, top_logprobs=1)], [1, 2], [0, 0], 4,
                           "cpu")
    tokens, _, (values, ids) = sample(logits, rows)
    assert tokens[1] == 1  # greedy
    assert ids.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(values[0], (logits[0] / 0.5).log_softmax(-1)[:2])


def mixed_settings(k: int) -> SamplingParams:
    """A spread of settings: temperatures, top-p, top-k, greedy rows."""
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.3, top_k=5), dict(temperature=0.0),
             dict(temperature=0.9, top_p=0.95, top_k=20)]
    return SamplingParams(max_new_tokens=10 + k % 7, seed=1000 + k, stop=("\x00never",),
                          **kinds[k % len(kinds)])


@pytest.mark.parametrize("mode", ["static", "continuous", "graphs"])
def test_seeded_requests_get_the_same_tokens_alone_and_among_64(tiny_model, tiny_tokenizer,
                                                                mode):
    """Each of 64 seeded requests with mixed settings gets, inside one batch of 64, the
    tokens it gets alone."""
    tok = tiny_tokenizer
    prompts = [tok.encode(f"prompt {k} " + "word " * (k % 9)) for k in range(64)]
    kw = {"continuous_batching": mode != "static", "prefix_cache": False,
          "max_batch_size": 64}
    if mode == "graphs":  # the GPU's captured path, through the CPU's stand-in
        kw.update(graph_standin=True, max_len=256)
    engine = HFEngine(tiny_model, tok, **kw)
    try:
        crowd = generate_together(engine, prompts, mixed_settings)  # one batch of 64
        crowd_steps = engine.stats["decode_steps"]
        alone = [asyncio.run(engine.generate(p, mixed_settings(k)))
                 for k, p in enumerate(prompts[:16])]
    finally:
        engine.close()
    # they decoded together: 64 requests of 10-16 tokens, one at a time, take >= 640 steps
    assert crowd_steps < 2 * 16, crowd_steps  # under twice the longest request
    for a, c in zip(alone, crowd):
        assert a.ids == c.ids
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-4)


def _ops(fn) -> list[str]:
    """The ATen ops ``fn()`` runs (recorded as the CPU's graph stand-in records them)."""
    from agentgym.core.recorded_graph import RecordedGraph
    graph = RecordedGraph()
    graph.record(fn)
    return [func._schema.name for func, *_ in graph.ops]


def test_top_k_rows_draw_from_a_prefilter_and_only_top_p_rows_sort_the_vocabulary():
    """A row with top-k <= PREFILTER sorts none of the vocabulary (``topk``); a row with
    top-p alone needs the whole order; a batch of both computes each for its own rows
    and each row draws what it draws alone."""
    from agentgym.rollout.engines.sampler import PREFILTER
    vocab = 4 * PREFILTER
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=g) * 3
    top_k = SamplingParams(temperature=1.0, top_k=40, top_p=0.9)
    top_p = SamplingParams(temperature=1.0, top_p=0.9)

    def draw(settings, rows):
        params = RowParams.build(settings, [11 + r for r in rows], [5] * len(rows), vocab,
                                 "cpu")
        out = {}
        ops = _ops(lambda: out.update(t=sample(logits[rows], params)[0]))
        return out["t"].tolist(), ops
    alone_k, ops_k = draw([top_k], [0])
    alone_p, ops_p = draw([top_p], [1])
    both, ops_both = draw([top_k, top_p], [0, 1])
    assert "aten::sort" not in ops_k and "aten::topk" in ops_k
    assert "aten::sort" in ops_p and "aten::topk" not in ops_p
    assert "aten::sort" in ops_both and "aten::topk" in ops_both
    assert both == alone_k + alone_p
