"""The SGLang client against real ``agentgym serve`` servers on loopback: routing over
several servers, retries of transient failures (and aborted requests) only, a dead
server (during rollouts, pause, resume, a weight update and close), weight sync by disk
and by a gloo broadcast group, weight-version checks, the server's 400s and stop
trimming, the pure pieces (weight-group ranks, the SGLang command line), and ``agentgym
train engine=sglang`` matching the in-process engine step for step."""

from __future__ import annotations

import asyncio
import collections
import copy
import json

import httpx
import pytest

from agentgym.config import Config, EngineConfig, RolloutConfig, build_config
from agentgym.core.overrides import parse_overrides
from agentgym.rollout.engines.base import push_weights
from agentgym.rollout.engines.hf import HFEngine
from agentgym.rollout.engines.launcher import launch_serve, sglang_command
from agentgym.rollout.engines.sglang import (EngineRequestError, SGLangEngine, SGLangServerError,
                                     ServerUnavailableError)
from agentgym.rollout.engines.sglang_weights import (group_ranks_of, tensor_update_body,
                                             weight_group_ranks)
from agentgym.rollout.manager import GenerationManager
from agentgym.core.types import GenerateOutput, SamplingParams
from engine_conformance import forward_logprobs, generate, perturbed
from fakes import FlakyProxyFault


@pytest.fixture(scope="module")
def two_servers(tiny_path):
    servers = [launch_serve(str(tiny_path)) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _talk_rollouts(engine, tokenizer, rows: int = 12, n: int = 2):
    from agentgym import envs
    cfg = RolloutConfig(n=n, max_turns=3, max_tokens_per_turn=6, max_response_tokens=200)
    factory = lambda: envs.make_env("agentgym-test/Talk-v0", max_turns=3)  # noqa: E731
    data = [{"prompt": [{"role": "user", "content": f"Talk #{i}"}],
             "extra_info": {"index": i}} for i in range(rows)]
    manager = GenerationManager(engine, tokenizer, factory, cfg, seed=3)
    try:
        return asyncio.run(manager.run(data))
    finally:
        manager.close()


def test_a_trajectory_stays_on_one_server_and_new_ones_spread(two_servers, tiny_tokenizer,
                                                               tiny_model):
    engine = SGLangEngine([s.url for s in two_servers], tiny_tokenizer)
    try:
        trajs = _talk_rollouts(engine, tiny_tokenizer)
    finally:
        engine.close()
    assert all(t.metrics["turns"] == 3 for t in trajs)
    by_session = collections.defaultdict(set)
    for session, url in engine.routes:
        by_session[session].add(url)
    assert len(by_session) == len(trajs) == 24
    assert all(len(urls) == 1 for urls in by_session.values())  # sticky: every turn
    per_server = collections.Counter(next(iter(u)) for u in by_session.values())
    assert set(per_server) == {s.url for s in two_servers}
    assert abs(per_server[two_servers[0].url] - per_server[two_servers[1].url]) <= 4
    # the same trajectories as the in-process engine (per-request seeds)
    local = HFEngine(copy.deepcopy(tiny_model), tiny_tokenizer)
    try:
        reference = _talk_rollouts(local, tiny_tokenizer)
    finally:
        local.close()
    assert [t.token_ids for t in trajs] == [t.token_ids for t in reference]
    for a, b in zip(trajs, reference):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_transient_failures_are_retried_and_bad_requests_are_not(two_servers, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("retry me")
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0)
    direct = SGLangEngine([two_servers[0].url], tiny_tokenizer)
    flaky = FlakyProxyFault(two_servers[0].url, fail_first=2, status=503)
    engine = SGLangEngine([flaky.url], tiny_tokenizer, retries=3, retry_window_s=0,
                          backoff_s=0.01)
    try:
        expected = generate(direct, [prompt], sampling)[0]
        out = generate(engine, [prompt], sampling)[0]
        assert out.ids == expected.ids and engine.stats["retries"] == 2
        assert flaky.seen["failed"] == 2
        # a 400 names the problem and is sent exactly once
        before = flaky.seen["forwarded"]
        with pytest.raises(EngineRequestError, match="outside the vocabulary") as err:
            generate(engine, [[10 ** 7]], sampling)
        assert err.value.status == 400
        assert flaky.seen["forwarded"] == before + 1 and engine.stats["retries"] == 2
    finally:
        engine.close()
        direct.close()
        flaky.close()
    # more failures than retries: a clear error that says how many attempts were made
    flaky = FlakyProxyFault(two_servers[0].url, fail_first=5, status=502)
    engine = SGLangEngine([flaky.url], tiny_tokenizer, retries=2, retry_window_s=0,
                          backoff_s=0.01)
    try:
        with pytest.raises(RuntimeError, match="failed after 3 attempts.*502"):
            generate(engine, [prompt], sampling)
    finally:
        engine.close()
        flaky.close()


def test_a_dead_server_loses_no_trajectory(two_servers, tiny_path, tiny_tokenizer):
    doomed = launch_serve(str(tiny_path))
    engine = SGLangEngine([doomed.url, two_servers[1].url], tiny_tokenizer, backoff_s=0.01)
    try:
        assert engine.health() == [True, True]
        doomed.kill()  # SIGKILL: connections refused from now on
        trajs = _talk_rollouts(engine, tiny_tokenizer, rows=4)
        assert engine.stats["retries"] >= 1  # the first refusal is retried elsewhere
        assert engine.health() == [False, True]
    finally:
        engine.close()
        doomed.stop()
    assert len(trajs) == 8 and all(t.metrics["turns"] == 3 for t in trajs)
    assert {url for _, url in engine.routes} == {two_servers[1].url}


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_weight_sync_reaches_every_server(two_servers, tiny_tokenizer, tiny_model, mode):
    engine = SGLangEngine([s.url for s in two_servers], tiny_tokenizer, weight_sync=mode)
    model = copy.deepcopy(tiny_model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=7)
    prompt = tiny_tokenizer.encode("sync")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    try:
        for version, weights in ((1, new), (2, original)):
            asyncio.run(engine.pause())
            engine.update_weights(weights, version)
            engine.resume()
            model.load_state_dict(weights)
            name = "model.layers.0.mlp.up_proj.weight"
            for server in two_servers:
                info = httpx.get(server.url + "/get_model_info").json()
                assert info["weight_version"] == str(version)
                got = httpx.get(server.url + "/get_weights_by_name",
                                params={"name": name, "truncate_size": 8}).json()
                assert got == pytest.approx(weights[name].flatten()[:8].tolist(), abs=1e-6)
            outs = generate(engine, [prompt] * 4, greedy)  # spread over both servers
            for out in outs:
                assert out.logprobs == pytest.approx(
                    forward_logprobs(model, prompt, out.ids, 0.0), abs=1e-4)
        if mode == "distributed":  # the group was sized from each server's tp_size
            assert [s.info["tp_size"] for s in engine.servers] == [1, 1]
    finally:
        engine.close()
    assert engine.policy_version == 2


def test_the_server_answers_bad_requests_with_400(two_servers):
    url = two_servers[0].url
    cases = [
        ({"text": "hello"}, "send input_ids"),
        ({"input_ids": []}, "non-empty list"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k=0: must be -1"),
        ({"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}, "min_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10 ** 9}},
         "context length"),
    ]
    with httpx.Client(timeout=30) as http:
        for body, needle in cases:
            r = http.post(url + "/generate", json=body)
            assert r.status_code == 400, body
            assert needle in r.json()["error"]["message"], (body, r.json())
        r = http.post(url + "/generate", content=b"{not json",
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        for path, body, needle in [
                ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "safetensors"),
                ("/init_weights_update_group", {"master_address": "127.0.0.1",
                                                "master_port": 1, "rank_offset": 1,
                                                "world_size": 2, "backend": "nccl"}, "gloo"),
                ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                                      "shapes": [[1]], "group_name": "none"},
                 "init_weights_update_group"),
                ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "CUDA IPC"),
                ("/pause_generation", {"mode": "sideways"}, "in_place")]:
            r = http.post(url + path, json=body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, r.text)
        # the server still serves
        ok = http.post(url + "/generate", json={"input_ids": [1, 2, 3], "return_logprob": True,
                                                 "sampling_params": {"max_new_tokens": 3,
                                                                     "temperature": 0}})
        assert ok.status_code == 200
        meta = ok.json()["meta_info"]
        assert meta["finish_reason"]["type"] in ("length", "stop")
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_bad_client_settings_fail_clearly(tiny_tokenizer):
    with pytest.raises(ValueError, match="engine.urls"):
        SGLangEngine([], tiny_tokenizer)
    with pytest.raises(ValueError, match="http://host:port"):
        SGLangEngine(["localhost:30000"], tiny_tokenizer)
    with pytest.raises(ValueError, match="valid: disk, distributed, tensor"):
        EngineConfig(weight_sync="nfs")
    assert EngineConfig(urls="http://a:1").urls == ["http://a:1"]
    cfg = Config()
    cfg.engine.name = "sglang"
    cfg.engine.urls = ["http://127.0.0.1:9"]  # nothing listens on port 9
    from agentgym.rollout.runtime import build_engine
    engine = build_engine(cfg, None, tiny_tokenizer)
    engine.retries, engine.retry_window_s, engine.backoff_s = 1, 0.0, 0.01
    try:
        with pytest.raises(RuntimeError, match="failed after 2 attempts.*ConnectError"):
            generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


def _train_args(run, extra=()):
    return ["env=search", "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2",
            "n=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=256",
            "trainer.eval_limit=2", "trainer.lr=1e-3", "trainer.cold_start=off",
            f"run_dir={run}", *extra]


def test_train_through_agentgym_serve_matches_the_in_process_engine(tmp_path, tiny_path,
                                                                    retriever_url):
    from agentgym.cli import main
    from agentgym.trainers.loop import train
    server = launch_serve(str(tiny_path))
    try:
        assert main(["train", *_train_args(tmp_path / "served", [
            f"retriever.url={retriever_url}", "engine=sglang",
            f"engine.urls=[{server.url}]"])]) == 0
        info = httpx.get(server.url + "/get_server_info").json()
    finally:
        server.stop()
    # v0 pushed at start (the server may hold anything), then one version per step
    assert info["weight_version"] == "2"
    assert info["internal_states"][0]["weight_updates"] == 3
    local = train(build_config(parse_overrides(_train_args(
        tmp_path / "local", [f"retriever.url={retriever_url}"]))))
    served = [json.loads(x) for x in (tmp_path / "served" / "metrics.jsonl").read_text()
              .splitlines()]
    here = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in served] == [r["step"] for r in here]
    steps = [r for r in served if "rollout/reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["rollout/policy_version"] == 1.0
    for a, b in zip(served, here):  # same samples, same losses: only the transport differs
        for key in ("rollout/reward", "rollout/response_length", "train/pg_loss",
                    "train/grad_norm", "eval/em", "rollout/drift_max"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


# -- a dead server during pause, resume, a weight update and close ----------------------
class _Owned:
    """Stands in for a server process the engine owns (``stop`` recorded or failing)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.stopped = fail, False

    def stop(self) -> None:
        self.stopped = True
        if self.fail:
            raise OSError("already gone")


def _generate_within(engine, prompt, seconds: float = 60.0):
    """One greedy generation that must not wait forever (a client left paused would)."""
    async def go():
        return await asyncio.wait_for(engine.generate(prompt, SamplingParams(
            max_new_tokens=3, temperature=0.0)), seconds)
    return asyncio.run(go())


def test_resume_reopens_the_client_when_a_server_is_gone(two_servers, tiny_path,
                                                         tiny_tokenizer):
    doomed = launch_serve(str(tiny_path))
    living = two_servers[1].url
    engine = SGLangEngine([doomed.url, living], tiny_tokenizer, retries=1, retry_window_s=0,
                          backoff_s=0.01)
    prompt = tiny_tokenizer.encode("resume")
    try:
        asyncio.run(engine.pause())
        doomed.kill()
        with pytest.raises(ServerUnavailableError, match="did not continue") as err:
            engine.resume()
        assert err.value.urls == [doomed.url]  # named, and a public type
        assert len(_generate_within(engine, prompt).ids) >= 1  # not held forever
        assert httpx.get(living + "/get_server_info").json()["paused"] is False
        # a pause that fails leaves nothing paused: the living server goes on, so do we
        with pytest.raises(SGLangServerError, match="pause_generation") as err:
            asyncio.run(engine.pause())
        assert doomed.url in err.value.urls[0]
        assert httpx.get(living + "/get_server_info").json()["paused"] is False
        assert len(_generate_within(engine, prompt).ids) >= 1
    finally:
        engine.close()
        doomed.stop()


def test_a_failed_weight_update_is_the_error_the_caller_sees(two_servers, tiny_path,
                                                             tiny_tokenizer, tiny_model):
    doomed = launch_serve(str(tiny_path))
    engine = SGLangEngine([doomed.url, two_servers[1].url], tiny_tokenizer, retries=1,
                          retry_window_s=0, backoff_s=0.01)
    try:
        asyncio.run(engine.pause())
        doomed.kill()
        # what push_weights does: update, then resume in `finally`; resume cannot reach
        # the dead server either, but the update's error is the one raised
        with pytest.raises(ServerUnavailableError, match="update_weights_from_disk") as err:
            try:
                engine.update_weights(tiny_model.state_dict(), 1)
            finally:
                engine.resume()
        assert err.value.urls == [doomed.url]
        assert engine.policy_version == 0  # not counted as pushed
        assert len(_generate_within(engine, tiny_tokenizer.encode("after")).ids) >= 1
        # the next push (the dead server still down) fails at pause, leaving us open
        with pytest.raises(SGLangServerError, match="pause_generation"):
            push_weights(engine, tiny_model.state_dict(), 2)
        assert len(_generate_within(engine, tiny_tokenizer.encode("again")).ids) >= 1
    finally:
        engine.close()
        doomed.stop()


def test_close_survives_dead_servers_and_stops_what_it_owns(two_servers, tiny_path,
                                                            tiny_tokenizer, tiny_model):
    doomed = launch_serve(str(tiny_path))
    owned = [_Owned(fail=True), _Owned()]
    engine = SGLangEngine([two_servers[1].url, doomed.url], tiny_tokenizer, retries=0,
                          retry_window_s=0, weight_sync="distributed", owned=owned)
    try:
        push_weights(engine, tiny_model.state_dict(), 1)  # a weight-update group exists
        assert engine.weight_group is not None
        doomed.kill()
        engine.close()  # cannot reach the dead server to leave the group: logs, goes on
        assert all(o.stopped for o in owned)
        assert engine.weight_group is None
        engine.close()  # idempotent
    finally:
        doomed.stop()
    # the living server left the group: a new client can form one under the same rule
    again = SGLangEngine([two_servers[1].url], tiny_tokenizer, weight_sync="distributed")
    try:
        push_weights(again, tiny_model.state_dict(), 1)
    finally:
        again.close()


# -- versions, aborts, cache ------------------------------------------------------------
def test_an_answer_from_another_weight_version_fails_loudly(two_servers, tiny_tokenizer,
                                                            tiny_model):
    url = two_servers[0].url
    ours = SGLangEngine([url], tiny_tokenizer)
    theirs = SGLangEngine([url], tiny_tokenizer)  # another trainer on the same server
    prompt = tiny_tokenizer.encode("whose weights")
    try:
        push_weights(ours, tiny_model.state_dict(), 1)
        assert len(_generate_within(ours, prompt).ids) >= 1
        push_weights(theirs, tiny_model.state_dict(), 5)
        with pytest.raises(SGLangServerError, match="weight_version '5'.*'1' was pushed last"):
            _generate_within(ours, prompt)
        assert ours.stats["retries"] == 0  # not a transient failure: not retried
    finally:
        ours.close()
        theirs.close()


#: What SGLang answers for an aborted request: 200, ``finish_reason`` ``abort``.
_ABORTED = json.dumps({"text": "", "output_ids": [], "meta_info": {
    "id": "x", "finish_reason": {"type": "abort", "message": "retracted"},
    "prompt_tokens": 1, "completion_tokens": 0, "cached_tokens": 0}}).encode()


def test_an_aborted_request_is_retried(two_servers, tiny_tokenizer):
    prompt = tiny_tokenizer.encode("abort me")
    direct = SGLangEngine([two_servers[0].url], tiny_tokenizer)
    proxy = FlakyProxyFault(two_servers[0].url, fail_first=1, status=200, body=_ABORTED)
    engine = SGLangEngine([proxy.url], tiny_tokenizer, retries=2, retry_window_s=0,
                          backoff_s=0.01)
    try:
        expected = _generate_within(direct, prompt)
        out = _generate_within(engine, prompt)
        assert out.ids == expected.ids and out.logprobs == pytest.approx(expected.logprobs)
        assert proxy.seen["failed"] == 1 and engine.stats["retries"] == 1
        proxy.left = 5  # aborted every time: a public error saying so
        with pytest.raises(ServerUnavailableError, match="failed after 3 attempts.*aborted"):
            _generate_within(engine, prompt)
    finally:
        engine.close()
        direct.close()
        proxy.close()


def test_flush_cache_reaches_every_server_and_a_dead_one_is_named(two_servers,
                                                                  tiny_tokenizer):
    def flushes():
        return [httpx.get(s.url + "/get_server_info").json()["internal_states"][0]
                ["cache_flushes"] for s in two_servers]
    engine = SGLangEngine([s.url for s in two_servers], tiny_tokenizer)
    try:
        before = flushes()
        engine.flush_cache()
        assert flushes() == [n + 1 for n in before]
    finally:
        engine.close()
    dead = SGLangEngine(["http://127.0.0.1:9"], tiny_tokenizer, retries=0,
                        retry_window_s=0)  # port 9: closed
    try:
        with pytest.raises(ServerUnavailableError, match="127.0.0.1:9/flush_cache"):
            dead.flush_cache()
    finally:
        dead.close()


def test_the_api_key_comes_from_the_environment(monkeypatch, tiny_tokenizer):
    from agentgym.rollout.runtime import build_engine
    cfg = Config()
    cfg.engine.name, cfg.engine.urls = "sglang", ["http://127.0.0.1:9"]
    monkeypatch.setenv("SGLANG_API_KEY", "sekrit")
    engine = build_engine(cfg, None, tiny_tokenizer)
    try:
        assert engine.headers["authorization"] == "Bearer sekrit"
    finally:
        engine.close()
    monkeypatch.delenv("SGLANG_API_KEY")
    engine = build_engine(cfg, None, tiny_tokenizer)
    try:
        assert "authorization" not in engine.headers
    finally:
        engine.close()


# -- stop trimming: output_ids keep the stop, only text is trimmed ----------------------
def test_output_ids_keep_the_stop_and_only_text_is_trimmed(two_servers, tiny_tokenizer):
    url = two_servers[0].url
    prompt = tiny_tokenizer.encode("Once upon a time")
    params = {"max_new_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        free = http.post(url + "/generate", json={"input_ids": prompt,
                                                   "sampling_params": params}).json()
        ids = free["output_ids"]
        k = next(i for i in range(1, len(ids))
                 if tiny_tokenizer.decode(ids[i:i + 1]).strip()
                 and tiny_tokenizer.decode(ids[i:i + 1]) not in tiny_tokenizer.decode(ids[:i]))
        stop = tiny_tokenizer.decode(ids[k:k + 1])
        answers = {}
        for keep in (False, True):
            answers[keep] = http.post(url + "/generate", json={
                "input_ids": prompt, "return_logprob": True, "sampling_params": {
                    **params, "stop": [stop], "no_stop_trim": keep,
                    "skip_special_tokens": False}}).json()
    for keep, a in answers.items():
        assert a["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert a["output_ids"] == ids[:k + 1]  # through the completing token, either way
        assert len(a["meta_info"]["output_token_logprobs"]) == k + 1
    full = tiny_tokenizer.decode(ids[:k + 1], skip_special_tokens=False)
    assert answers[True]["text"] == full
    assert answers[False]["text"] == full[:full.find(stop)]


def test_a_matched_eos_stays_in_output_ids(tiny_model, tiny_tokenizer):
    """SGLang trims a matched stop token from ``text`` only (``no_stop_trim`` false);
    ``output_ids`` and the logprobs keep it."""
    from types import SimpleNamespace

    from agentgym.serving.serve import ServeState
    eos = tiny_tokenizer.eos_token_id

    async def fake_generate(ids, sampling):
        return GenerateOutput([5, eos], [-1.0, -2.0], "stop", "<eos>")
    engine = SimpleNamespace(model=tiny_model, tokenizer=tiny_tokenizer, eos_ids={eos},
                             generate=fake_generate)
    state = ServeState(engine, "tiny")
    for keep in (False, True):
        a = asyncio.run(state.generate_one([1, 2], SamplingParams(max_new_tokens=4), keep,
                                           True, "r", skip_special_tokens=False))
        assert a["output_ids"] == [5, eos]
        assert a["meta_info"]["output_token_logprobs"] == [[-1.0, 5, None], [-2.0, eos, None]]
        assert a["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert a["text"] == tiny_tokenizer.decode([5, eos] if keep else [5],
                                                  skip_special_tokens=False)


def test_a_tied_copy_sent_anyway_is_ignored_like_sglang(two_servers, tiny_model, tmp_path):
    """SGLang's loaders skip ``lm_head.weight`` under ``tie_word_embeddings``: the
    embedding's value counts (``agentgym serve`` does the same)."""
    from safetensors.torch import save_file
    url = two_servers[1].url
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] + 1.0
    state["lm_head.weight"] = state["lm_head.weight"] - 1.0  # disagrees: must not win
    (tmp_path / "w").mkdir()
    save_file(state, str(tmp_path / "w" / "model.safetensors"))
    original = tmp_path / "orig"
    original.mkdir()
    save_file({k: v.clone() for k, v in tiny_model.state_dict().items()
               if k != "lm_head.weight"}, str(original / "model.safetensors"))
    with httpx.Client(timeout=60) as http:
        try:
            r = http.post(url + "/update_weights_from_disk",
                          json={"model_path": str(tmp_path / "w")})
            assert r.status_code == 200 and r.json()["success"], r.text
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                got = http.get(url + "/get_weights_by_name",
                               params={"name": name, "truncate_size": 6}).json()
                assert got == pytest.approx(
                    state["model.embed_tokens.weight"].flatten()[:6].tolist(), abs=1e-6)
        finally:
            r = http.post(url + "/update_weights_from_disk", json={"model_path": str(original)})
            assert r.status_code == 200, r.text


# -- pure pieces ------------------------------------------------------------------------
def test_weight_group_ranks_give_every_tp_worker_its_own_rank():
    assert weight_group_ranks([1]) == (2, [1])
    assert weight_group_ranks([1, 1]) == (3, [1, 2])
    assert weight_group_ranks([2, 4]) == (7, [1, 3])
    for sizes in ([1], [2, 2], [4, 1, 2], [8, 8, 1, 3]):
        world, offsets = weight_group_ranks(sizes)
        ranks = [off + tp_rank for off, tp in zip(offsets, sizes) for tp_rank in range(tp)]
        assert sorted(ranks) == list(range(1, world))  # disjoint, none is the trainer's 0
    with pytest.raises(ValueError, match=">= 1"):
        weight_group_ranks([2, 0])
    assert group_ranks_of({"tp_size": 4, "dp_size": 1, "pp_size": 1}, "u") == 4
    assert group_ranks_of({}, "u") == 1  # an old server without /server_info
    assert group_ranks_of({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, "u") == 4
    for bad in ({"tp_size": 2, "pp_size": 2}, {"tp_size": 2, "dp_size": 2}):
        with pytest.raises(ValueError, match="same rank"):
            group_ranks_of(bad, "http://x")
    body = tensor_update_body("payload", 4, 3)
    assert body["serialized_named_tensors"] == ["payload"] * 4  # one per TP rank
    assert body["weight_version"] == "3"


def test_the_sglang_command_line():
    cmd = sglang_command("/models/Qwen2.5-0.5B-Instruct", 30001, dtype="bfloat16", seed=7,
                         tp_size=2, mem_fraction_static=0.6, deterministic=True,
                         extra_args=["--attention-backend", "triton"])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]

    def flag(name):
        return cmd[cmd.index(name) + 1]
    assert flag("--model-path") == "/models/Qwen2.5-0.5B-Instruct"
    assert flag("--host") == "127.0.0.1" and flag("--port") == "30001"
    assert flag("--dtype") == "bfloat16" and flag("--tp-size") == "2"
    assert flag("--random-seed") == "7" and flag("--mem-fraction-static") == "0.6"
    assert "--skip-tokenizer-init" in cmd and "--enable-deterministic-inference" in cmd
    assert cmd[-2:] == ["--attention-backend", "triton"]
    plain = sglang_command("/m", 30000, dtype="", skip_tokenizer_init=False)
    assert plain[plain.index("--dtype") + 1] == "auto"
    assert "--skip-tokenizer-init" not in plain and "--random-seed" not in plain
    assert "--mem-fraction-static" not in plain
