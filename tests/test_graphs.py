"""The captured-graph path on the CPU, through the stand-in for ``torch.cuda.CUDAGraph``
(agentgym.core.recorded_graph): the stand-in keeps a CUDA graph's properties, and the
engine's GPU path (bucket padding, capture before serving, static buffers, CUDA's
attention layout) runs here with the tokens and logprobs of the eager path."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentgym.core.device import capture_graph, is_capturing
from agentgym.core.recorded_graph import HostSyncInCapture, RecordedGraph
from agentgym.core.types import SamplingParams
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.model_runner import ModelRunner
from test_model_runner import pool_for, prefill, reference, shrunk

CPU = torch.device("cpu")


# -- the stand-in ---------------------------------------------------------------------------

def test_a_recorded_step_replays_over_whatever_its_tensors_hold():
    x, y, out = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)
    calls = []

    def step():
        calls.append(1)  # Python between the ops runs while recording only
        z = x * 3  # a tensor made inside the step keeps its storage across replays
        out.copy_(z + y)
    graph = capture_graph(step, None, CPU, warmup=2)
    assert isinstance(graph, RecordedGraph) and len(calls) == 3  # 2 warm-ups + recording
    torch.testing.assert_close(out, torch.full((3,), 5.0))
    x.fill_(10.0)
    out.zero_()
    graph.replay()
    assert len(calls) == 3
    torch.testing.assert_close(out, torch.full((3,), 32.0))


def test_a_tensor_swapped_after_capture_is_not_seen_by_a_replay():
    table, out = {"t": torch.ones(2)}, torch.zeros(2)
    graph = capture_graph(lambda: out.copy_(table["t"] * 2), None, CPU, warmup=0)
    table["t"] = torch.full((2,), 7.0)  # a new tensor: the graph still reads the old one
    graph.replay()
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_a_host_sync_inside_a_capture_is_refused_and_capturing_is_seen():
    x = torch.ones(2)
    seen = []

    def step():
        seen.append(is_capturing(CPU))
        if len(seen) == 2:  # the recording
            x.sum().item()
    with pytest.raises(HostSyncInCapture, match="item"):
        capture_graph(step, None, CPU, warmup=1)
    assert seen == [False, True] and not is_capturing(CPU)


# -- the runner on the GPU's path ----------------------------------------------------------

@pytest.mark.parametrize("graphs", [False, True])
def test_grouped_query_attention_in_cudas_output_layout(graphs):
    """smollm2's 9 query heads over 3 key/value heads: with the attention output in the
    transposed layout CUDA's memory-efficient kernel returns, the prefill and decode
    logits are still the model's own (a ``.view`` merging the head dims would raise)."""
    model = shrunk("smollm2-135m")
    assert model.config.num_attention_heads != model.config.num_key_value_heads
    pool = pool_for(model, slots=4, capacity=128, growable=False)
    runner = ModelRunner(model, pool, graphs=graphs, standin=True)
    assert runner.gpu_path and runner.packed is None
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    with torch.inference_mode():
        logits = prefill(runner, pool, prompts)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i].float(), reference(model, p), atol=2e-5,
                                       rtol=0)
        logits = runner.decode(torch.tensor([20, 21]), torch.tensor([7, 3]), 8).float()
    for i, p in enumerate(prompts):
        torch.testing.assert_close(logits[i], reference(model, p + [20 + i]), atol=2e-5,
                                   rtol=0)
    assert runner.stats["graph_replays" if graphs else "eager_steps"] == 1


def _decode_steps(runner, pool, prompts, steps):
    """Prefill ``prompts`` in slots 0.. and take ``steps`` decode steps of fixed tokens;
    the logits of each step."""
    lengths, out = [len(p) for p in prompts], []
    with torch.inference_mode():
        prefill(runner, pool, prompts)
        for k in range(steps):
            ids = torch.tensor([30 + k + i for i in range(len(prompts))])
            out.append(runner.decode(ids, torch.tensor(lengths), max(lengths) + 1)
                       .float().clone())
            lengths = [n + 1 for n in lengths]
    return torch.stack(out)


def test_the_captured_decode_step_equals_the_eager_step_on_the_stand_in():
    model = shrunk("qwen2.5-0.5b")
    prompts = [[5 + i, 6, 7 + i, 8, 9][:3 + i % 3] for i in range(5)]
    got = {}
    for graphs in (False, True):
        pool = pool_for(model, slots=8, capacity=256, growable=False)
        runner = ModelRunner(model, pool, graphs=graphs, standin=True)
        got[graphs] = _decode_steps(runner, pool, prompts, 4)
    assert runner.stats["graph_replays"] == 4 and runner.stats["eager_steps"] == 0
    torch.testing.assert_close(got[True], got[False], atol=1e-5, rtol=0)


def test_a_capture_in_the_middle_of_a_running_batch_leaves_live_rows_kv_bit_identical():
    """Three rows decode; a step whose bucket was never captured captures it while they
    are live: every column a row had before the step keeps its keys/values bit for bit,
    and the step's own column holds what an eager step writes."""
    model = shrunk("smollm2-135m")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]]
    pool = pool_for(model, slots=8, capacity=256, growable=False)
    runner = ModelRunner(model, pool, graphs=True, standin=True)
    eager_pool = pool_for(model, slots=8, capacity=256, growable=False)
    eager = ModelRunner(model, eager_pool, standin=True)
    with torch.inference_mode():
        _decode_steps(runner, pool, prompts, 2)  # captures (4 rows, 128 columns)
        _decode_steps(eager, eager_pool, prompts, 2)
        lengths = [len(p) + 2 for p in prompts]
        before = [pool.kv_of(s, 0, n).clone() for s, n in enumerate(lengths)]
        assert (4, 192) not in runner.captured()
        captures = runner.stats["captured_while_serving"]
        ids, pos = torch.tensor([40, 41, 42]), torch.tensor(lengths)
        got = runner.decode(ids, pos, 150).float().clone()  # a new column bucket: 192
        want = eager.decode(ids, pos, 150).float()
    assert runner.stats["captured_while_serving"] == captures + 1
    for s, n in enumerate(lengths):
        assert torch.equal(pool.kv_of(s, 0, n), before[s]), f"row {s}'s keys/values moved"
        torch.testing.assert_close(pool.kv_of(s, n, n + 1), eager_pool.kv_of(s, n, n + 1),
                                   atol=1e-5, rtol=0)  # 4 padded rows vs 3: other blocking
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_capture_all_covers_every_bucket_and_refuses_live_rows():
    model = shrunk("smollm2-135m")
    pool = pool_for(model, slots=6, capacity=200, growable=False)
    runner = ModelRunner(model, pool, graphs=True, standin=True)
    keys = runner.buckets()
    assert keys == sorted(((r, c) for r in (1, 2, 4, 6) for c in (128, 192, 200)),
                          reverse=True)
    with torch.inference_mode():
        assert runner.capture_all() == len(keys)
        assert runner.captured() == set(keys)
        assert runner.capture_all() == 0  # nothing left
        prefill(runner, pool, [[5, 6, 7]])
        with pytest.raises(RuntimeError, match="live rows"):  # a runner with none captured
            ModelRunner(model, pool, graphs=True, standin=True).capture_all()


def test_the_rotary_table_graphs_read_is_never_replaced():
    """A staging pool that outgrows the model's context (its columns double) does not
    replace the rotary table a captured step reads: the table follows the positions a
    forward needs, which the decode pool bounds."""
    model = shrunk("smollm2-135m")
    model.config.max_position_embeddings = 96
    pool = pool_for(model, slots=2, capacity=96, growable=False)
    runner = ModelRunner(model, pool, graphs=True, standin=True)
    staging = pool_for(model, slots=0, capacity=0, growable=True)
    prompt = list(range(5, 5 + 70))
    with torch.inference_mode():
        runner.capture_all()
        table = runner.rope_table
        staging.add(0, len(prompt))  # doubles to 256 columns, past the table's 96
        assert staging.capacity > table.shape[0]
        n = len(prompt)
        runner.prefill(torch.tensor([prompt]), torch.arange(n)[None], torch.ones(1, n,
                       dtype=torch.bool), torch.tensor([0]), torch.tensor([n - 1]), n,
                       staging)
        pool.add(0, n)
        pool.copy_from(staging, 0, 0, n)
        logits = runner.decode(torch.tensor([3]), torch.tensor([n]), n + 1).float()
    assert runner.rope_table is table
    torch.testing.assert_close(logits[0], reference(model, prompt + [3]), atol=2e-5, rtol=0)


# -- the engine on the GPU's path ----------------------------------------------------------

def test_the_engine_captures_every_bucket_before_serving(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=8, max_len=256,
                      graph_standin=True)
    runner = engine.scheduler.runner
    try:
        assert runner.graphs and not engine.scheduler.decode.growable
        assert runner.stats["graphs"] == len(runner.buckets()) > 0
        prompts = [tiny_tokenizer.encode(f"question {k}: " + "why " * k) for k in range(6)]
        sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)

        async def go():
            return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        outs = asyncio.run(go())
    finally:
        engine.close()
    assert all(len(o.ids) >= 1 for o in outs)
    assert runner.stats["graph_replays"] > 0 and runner.stats["eager_steps"] == 0
    assert runner.stats["captured_while_serving"] == 0


def _settings(k: int) -> SamplingParams:
    kinds = [dict(temperature=1.0, top_logprobs=3), dict(temperature=0.7, top_p=0.8),
             dict(temperature=1.3, top_k=5, top_logprobs=2), dict(temperature=0.0),
             dict(temperature=0.9, top_p=0.95, top_k=20)]
    return SamplingParams(max_new_tokens=6 + k % 5, seed=77 + k, **kinds[k % len(kinds)])


def test_the_captured_sampler_gives_the_eager_engines_tokens_logprobs_and_alternatives(
        tiny_model, tiny_tokenizer):
    """Rows of mixed settings (greedy, top-p alone, top-k, both; some asking for
    alternatives) through the captured forward and sampler equal the eager engine's,
    alternatives included; every step's sampling replays a captured sampler, and rows
    join and leave on the device without draining the step in flight."""
    prompts = [tiny_tokenizer.encode(f"item {k}: " + "so " * (k % 4)) for k in range(10)]
    got = {}
    for standin in (False, True):
        engine = HFEngine(tiny_model, tiny_tokenizer, max_batch_size=16, prefix_cache=False,
                          graph_standin=standin, max_len=256, batch_wait_s=0.05)

        async def go():
            return await asyncio.gather(*(engine.generate(p, _settings(k))
                                          for k, p in enumerate(prompts)))
        try:
            got[standin] = asyncio.run(go())
        finally:
            engine.close()
        rebuilt = engine.stats["rows_rebuilt"]
        if standin:  # rows joined and left on the device, never waiting for a step
            decoder = engine.scheduler.decoder
            assert decoder.stats["sampler_graphs"] >= 1
            assert decoder.stats["joins"] == decoder.stats["leaves"] == len(prompts)
            assert engine.scheduler.runner.stats["eager_steps"] == 0
            assert rebuilt == 0
        else:  # the CPU's eager path rebuilds the rows from the host at each change
            assert rebuilt > 0
    for k, (a, b) in enumerate(zip(got[False], got[True])):
        assert a.ids == b.ids, k
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        if _settings(k).top_logprobs:
            assert len(b.top_logprobs) == len(b.ids)
            for x, y in zip(a.top_logprobs, b.top_logprobs):
                assert [i for i, _ in x] == [i for i, _ in y]
                assert [v for _, v in x] == pytest.approx([v for _, v in y], abs=1e-4)
        else:
            assert b.top_logprobs is None
