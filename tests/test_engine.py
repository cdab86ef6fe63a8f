"""HF engine: batching, stop handling, seeds, and logprobs equal to a trainer forward pass,
in its modes: static batches, continuous batching, continuous batching with the prefix
cache (the default), and the GPU's captured-graph path run on the CPU's stand-in."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from agentgym.rollout.engines.hf import HFEngine
from agentgym.core.types import SamplingParams

PROMPTS = ["<search> capital of france", "hello there, how are you today?",
           "Question: who wrote hamlet?\n", "a"]

#: engine keyword arguments of each mode
MODES = {"static": {"continuous_batching": False, "prefix_cache": False},
         "continuous": {"prefix_cache": False},
         "cached": {},
         # the GPU's path on the CPU: captured graphs through the stand-in, a fixed pool
         "graphs": {"graph_standin": True, "max_len": 512}}


def trainer_logprobs(model, ids: list[int], prompt_len: int, temperature: float) -> list[float]:
    """What a trainer computes: one unpadded forward pass over the finished sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    targets = torch.tensor(ids[1:])
    return logp.gather(1, targets[:, None])[:, 0][prompt_len - 1:].tolist()


def generate_together(engine, prompts, settings):
    """Every prompt (``settings(k)`` for the k-th) queued while the engine is paused, then
    started at once: they are admitted together."""
    async def go():
        await engine.pause()
        tasks = [asyncio.ensure_future(engine.generate(p, settings(k)))
                 for k, p in enumerate(prompts)]
        deadline = asyncio.get_running_loop().time() + 120
        while engine.waiting() < len(prompts):
            assert asyncio.get_running_loop().time() < deadline, "requests never queued"
            await asyncio.sleep(0.001)
        engine.resume()
        return await asyncio.gather(*tasks)
    return asyncio.run(go())


def generate_all(engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    return asyncio.run(go())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_trainer_forward(tiny_model, tiny_tokenizer, temperature, mode):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_wait_s=0.05, **MODES[mode])
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    outs = generate_all(engine, prompts, SamplingParams(max_new_tokens=24,
                                                        temperature=temperature, seed=1))
    engine.close()
    assert engine.stats["max_rows"] == 4  # the concurrent requests decoded together
    worst = 0.0
    for p, out in zip(prompts, outs):
        assert len(out.ids) == len(out.logprobs) > 0
        ref = trainer_logprobs(tiny_model, p + out.ids, len(p), temperature)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, ref)))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("mode", MODES)
def test_greedy_matches_transformers_generate(tiny_model, tiny_tokenizer, mode):
    engine = HFEngine(tiny_model, tiny_tokenizer, **MODES[mode])
    prompt = tiny_tokenizer.encode("The capital of France is")
    out = generate_all(engine, [prompt, tiny_tokenizer.encode("x y z")],
                       SamplingParams(max_new_tokens=16, temperature=0))[0]
    engine.close()
    ref = tiny_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), max_new_tokens=len(out.ids), do_sample=False,
                              eos_token_id=tiny_tokenizer.eos_token_id,
                              pad_token_id=tiny_tokenizer.pad_token_id)[0, len(prompt):]
    assert out.ids == ref.tolist()[:len(out.ids)]


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sample_independent_of_batch_companions(tiny_model, tiny_tokenizer, mode):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_wait_s=0.05, **MODES[mode])
    prompt = tiny_tokenizer.encode("same prompt")
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42)
    alone = generate_all(engine, [prompt], sp)[0]
    others = [tiny_tokenizer.encode(p) for p in PROMPTS]
    crowded = generate_all(engine, others + [prompt], sp)[-1]
    engine.close()
    assert alone.ids == crowded.ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, crowded.logprobs)) < 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_stop_strings_cut_exactly_and_length(tiny_model, tiny_tokenizer, mode):
    engine = HFEngine(tiny_model, tiny_tokenizer, **MODES[mode])
    tok = tiny_tokenizer
    prompt = tok.encode("go")
    seeded = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, stop=("\x00never",))
    free = generate_all(engine, [prompt], seeded)[0]
    assert free.finish_reason == "length" and len(free.ids) == 20  # exactly the budget
    # Pick a stop string that first completes at token k of the seeded continuation.
    k = next(i for i in range(3, 20) if tok.decode(free.ids[i:i + 1]).strip()
             and tok.decode(free.ids[i:i + 1]) not in tok.decode(free.ids[:i]))
    stop = tok.decode(free.ids[k:k + 1])
    cut = generate_all(engine, [prompt], SamplingParams(max_new_tokens=20, temperature=1.0,
                                                        seed=5, stop=(stop,)))[0]
    engine.close()
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.ids == free.ids[:k + 1]  # stopped on the token that completed the string
    assert cut.logprobs == pytest.approx(free.logprobs[:k + 1], abs=1e-5)


@pytest.mark.parametrize("mode", ["static", "cached"])
def test_update_weights_changes_outputs_and_needs_an_idle_engine(tiny_model, tiny_tokenizer,
                                                                mode):
    """A weight update waits for an idle engine, and a new version never reuses the old
    version's cached keys/values (its logprobs are the new weights' own)."""
    import copy
    import threading
    model = copy.deepcopy(tiny_model)
    engine = HFEngine(model, tiny_tokenizer, **MODES[mode])
    prompt = tiny_tokenizer.encode("weights")
    sp = SamplingParams(max_new_tokens=4, temperature=0)
    before = generate_all(engine, [prompt], sp)[0]
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g)
                 for k, v in model.state_dict().items()}
    inside, release = threading.Event(), threading.Event()

    def hold(module, args):  # fault injection: the next forward waits for the test
        inside.set()
        release.wait(timeout=120)

    async def busy_then_swap():
        handle = model.register_forward_pre_hook(hold)
        pending = asyncio.ensure_future(engine.generate(prompt, sp))
        assert await asyncio.to_thread(inside.wait, 120)  # the worker is busy
        with pytest.raises(RuntimeError, match="pause"):
            engine.update_weights(perturbed, version=1)
        handle.remove()
        release.set()
        await pending
        await engine.pause()
        engine.update_weights(perturbed, version=1)
        engine.resume()
        return await engine.generate(prompt, sp)
    cached = engine.stats["cached_tokens"]
    after = asyncio.run(busy_then_swap())
    engine.close()
    assert engine.policy_version == 1
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)
    assert after.logprobs == pytest.approx(
        trainer_logprobs(model, prompt + after.ids, len(prompt), 1.0), abs=1e-4)
    if mode == "cached":  # the second request (old weights) reused the prompt, the third not
        assert engine.stats["cached_tokens"] == cached + len(prompt) - 1
        assert engine.prefix.stats["clears"] == 1


def test_bad_requests_fail_clearly(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(engine.generate([], SamplingParams()))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate([1], SamplingParams()))


def test_requests_arriving_in_a_stream_share_a_batch_within_the_cap(tiny_model, tiny_tokenizer):
    """Static batching: a batch starts once no request arrived for batch_wait_s, or max_batch_wait_s after
    its first request (margins of 3x and more, so a loaded machine does not flip it)."""
    sp = SamplingParams(max_new_tokens=2, temperature=0.0)
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS + PROMPTS[:2]]

    async def stream(engine, gap_s):
        tasks = []
        for p in prompts:  # 6 requests, gap_s apart: spread over 5 gaps
            tasks.append(asyncio.create_task(engine.generate(p, sp)))
            await asyncio.sleep(gap_s)
        return await asyncio.gather(*tasks)

    for cap, want_one_batch in ((30.0, True), (0.25, False)):
        engine = HFEngine(tiny_model, tiny_tokenizer, batch_wait_s=0.25, max_batch_wait_s=cap,
                          **MODES["static"])
        try:
            asyncio.run(stream(engine, 0.08))  # 0.4 s in all: > one quiet gap, < the cap
            assert (engine.stats["batches"] == 1) is want_one_batch, engine.stats
            assert engine.stats["requests"] == len(prompts)
        finally:
            engine.close()


# -- run(): the engine's steps on the caller's thread (the CPU) ---------------------------
def record_step_threads(engine) -> set:
    """The threads that run the engine's steps from now on (the real step, wrapped)."""
    threads, step = set(), engine.scheduler.step

    def recorded():
        threads.add(threading.current_thread().name)
        step()
    engine.scheduler.step = recorded
    return threads


def test_run_steps_on_the_calling_thread_with_the_same_samples(tiny_model, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    engine = HFEngine(tiny_model, tiny_tokenizer)
    try:
        threads = record_step_threads(engine)
        via_thread = generate_all(engine, prompts, sp)  # asyncio.run: the engine's thread
        assert threads == {"hf-engine"}
        threads.clear()
        assert engine.flush_cache()  # each pass prefills afresh: the same logits

        async def go():
            return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        here = engine.run(go())
        assert threads == {threading.current_thread().name}
        threads.clear()
        assert engine.flush_cache()
        again = generate_all(engine, prompts, sp)  # the engine's thread took over again
        assert threads == {"hf-engine"}
    finally:
        engine.close()
    for a, b, c in zip(via_thread, here, again):
        assert a.ids == b.ids == c.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_run_serves_other_callers_and_raises_its_rollouts_error(tiny_model, tiny_tokenizer):
    """Another thread's requests during run() are stepped by run()'s thread; an error in
    the rollout reaches run()'s caller and leaves the engine serving."""
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("same prompt")
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=9)
    try:
        alone = generate_all(engine, [prompt], sp)[0]
        assert engine.flush_cache()  # each pass prefills afresh: the same logits
        threads = record_step_threads(engine)
        other: dict = {}

        def elsewhere():  # its own event loop, in its own thread
            other["out"] = generate_all(engine, [prompt], sp)[0]

        async def rollout():
            caller = threading.Thread(target=elsewhere)
            caller.start()
            mine = await engine.generate(tiny_tokenizer.encode("x y z"), sp)
            await asyncio.to_thread(caller.join, 120)
            return mine
        mine = engine.run(rollout())
        assert other["out"].ids == alone.ids and len(mine.ids) > 0
        assert threads == {threading.current_thread().name}  # the other caller's too

        async def broken():
            await engine.generate(prompt, sp)
            raise ValueError("a bad row")
        with pytest.raises(ValueError, match="a bad row"):
            engine.run(broken())
        assert engine.flush_cache()
        assert generate_all(engine, [prompt], sp)[0].ids == alone.ids
    finally:
        engine.close()


def test_drive_steps_another_threads_requests_here_until_the_engine_closes(
        tiny_model, tiny_tokenizer):
    """What ``agentgym serve`` does: the HTTP server's event loop on a helper thread, the
    engine's steps on the thread that called drive(), which returns when the engine
    closes; the samples are those of the engine's own thread."""
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    engine = HFEngine(tiny_model, tiny_tokenizer)
    try:
        via_thread = generate_all(engine, prompts, sp)
        assert engine.flush_cache()
        threads = record_step_threads(engine)
        served: dict = {}

        def server():  # its own event loop, as uvicorn's
            try:
                # once drive() has claimed the steps (before that the engine's own thread
                # would step what is sent, as it does for a server not driven)
                deadline = time.monotonic() + 120
                while engine.stepping_thread() is not threading.main_thread():
                    assert time.monotonic() < deadline, "drive() never took the steps"
                    time.sleep(0.001)
                served["out"] = generate_all(engine, prompts, sp)
            finally:
                engine.close()  # as serve's HTTP thread does when it stops
        helper = threading.Thread(target=server)
        helper.start()
        engine.drive()  # returns when server() closes the engine
        helper.join(120)
        assert not helper.is_alive()
    finally:
        engine.close()
    assert threads == {threading.current_thread().name}
    for a, b in zip(via_thread, served["out"]):
        assert a.ids == b.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_run_on_a_closed_engine_fails_its_requests(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    engine.close()

    async def go():
        return await engine.generate(tiny_tokenizer.encode("a"), SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.run(go())


def test_a_short_prompt_at_the_head_does_not_chop_the_others_into_its_width(
        tiny_model, tiny_tokenizer):
    """Prompts of 10, 300 and 150 tokens waiting together, 512 prefill tokens a pass: the
    first pass takes the 10 and the 150 at width 150 (the 300 would make it 3 x 300), the
    second the 300: two passes, where a width set by the head's 10 tokens took three.
    Each request samples what it samples alone."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (10, 300, 150)]
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    engine = HFEngine(tiny_model, tiny_tokenizer, prefill_chunk=512, prefix_cache=False)
    try:
        crowd = generate_together(engine, prompts, lambda k: sp)
        passes = engine.stats["prefill_passes"]
        alone = [generate_all(engine, [p], sp)[0] for p in prompts]
    finally:
        engine.close()
    assert passes == 2
    for a, c in zip(alone, crowd):
        assert a.ids == c.ids
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-4)


def test_run_from_one_thread_then_another_hands_the_steps_on_each_time(
        tiny_model, tiny_tokenizer):
    """run() after run() from alternating threads: each caller gets the steps (the engine's
    own thread takes them back in between, and hands them on at once to a caller already
    waiting), and every rollout finishes."""
    prompt = tiny_tokenizer.encode(PROMPTS[0])
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=2)
    engine = HFEngine(tiny_model, tiny_tokenizer)
    done: list = []

    async def one():
        return await engine.generate(prompt, sp)

    def caller(k: int) -> None:
        for _ in range(40):
            done.append((k, engine.run(one()).ids))
    try:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a run() never got the steps"
        assert engine.stepping_thread() is not None
        assert generate_all(engine, [prompt], sp)[0].ids == done[0][1]  # still serving
    finally:
        engine.close()
    assert len(done) == 80 and len({tuple(ids) for _, ids in done}) == 1  # seeded: equal


def test_a_failed_preemption_fails_the_running_requests_and_the_engine_goes_on(
        tiny_model, tiny_tokenizer):
    """Fault injection: taking in the step in flight raises while a partial pause stops
    the running requests. They fail with that error, the pause returns, and the engine
    serves the next request."""
    engine = HFEngine(tiny_model, tiny_tokenizer, prefix_cache=False)
    prompt = tiny_tokenizer.encode(PROMPTS[1])
    sp = SamplingParams(max_new_tokens=200, temperature=1.0, seed=4, stop=("\x00never",))
    drain = engine.scheduler.drain
    armed = threading.Event()

    def failing_drain():  # the fault: only once armed, only in the preemption's drain
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected drain failure")
        drain()

    async def go():
        task = asyncio.ensure_future(engine.generate(prompt, sp))
        deadline = asyncio.get_running_loop().time() + 120
        while engine.stats["decode_steps"] < 2:  # decoding: the request is running
            assert asyncio.get_running_loop().time() < deadline, "never decoded"
            await asyncio.sleep(0.001)
        engine.scheduler.drain = failing_drain
        armed.set()
        await engine.pause(partial=True)
        engine.resume()
        with pytest.raises(RuntimeError, match="injected drain failure"):
            await task
        engine.scheduler.drain = drain
        return await engine.generate(prompt, SamplingParams(max_new_tokens=4, seed=1))
    try:
        after = engine.run(go())
    finally:
        engine.close()
    assert len(after.ids) == 4


def test_a_closed_engine_refuses_updates_and_flushes_nothing(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    engine.close()
    assert engine.idle() and engine.stepping_thread() is None
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.update_weights(tiny_model.state_dict(), 1)
    assert engine.flush_cache() is False
    engine.resume()  # nothing to resume: no command is left pending
    assert engine.idle()
