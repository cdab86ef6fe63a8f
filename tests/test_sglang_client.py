"""The SGLang client against real ``agentgym serve`` servers on loopback: routing over
several servers, retries of transient failures only, a dead server, weight sync by disk
and by a gloo broadcast group, the server's 400s, and ``agentgym train engine=sglang``
matching the in-process engine step for step."""

from __future__ import annotations

import asyncio
import collections
import copy
import json

import httpx
import pytest

from agentgym.config import Config, EngineConfig, RolloutConfig, build_config, parse_overrides
from agentgym.engines.hf import HFEngine
from agentgym.engines.launcher import launch_serve
from agentgym.engines.sglang import EngineRequestError, SGLangEngine
from agentgym.manager import GenerationManager
from agentgym.types import SamplingParams
from engine_conformance import forward_logprobs, generate, perturbed
from fakes import FlakyProxyFault


@pytest.fixture(scope="module")
def two_servers(tiny_path):
    servers = [launch_serve(str(tiny_path)) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _talk_rollouts(engine, tokenizer, rows: int = 12, n: int = 2):
    import envs
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
    engine = SGLangEngine([flaky.url], tiny_tokenizer, retries=3, backoff_s=0.01)
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
    engine = SGLangEngine([flaky.url], tiny_tokenizer, retries=2, backoff_s=0.01)
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
        assert engine.health() == [False, True]
        trajs = _talk_rollouts(engine, tiny_tokenizer, rows=4)
    finally:
        engine.close()
        doomed.stop()
    assert len(trajs) == 8 and all(t.metrics["turns"] == 3 for t in trajs)
    assert engine.stats["retries"] >= 1
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
    from agentgym.runtime import build_engine
    engine = build_engine(cfg, None, tiny_tokenizer)
    engine.retries, engine.backoff_s = 1, 0.01
    try:
        with pytest.raises(RuntimeError, match="failed after 2 attempts.*ConnectError"):
            generate(engine, [[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


def _train_args(run, extra=()):
    return ["env=search", "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2",
            "n=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=256",
            "trainer.eval_limit=2", "trainer.lr=1e-3", f"run_dir={run}", *extra]


def test_train_through_agentgym_serve_matches_the_in_process_engine(tmp_path, tiny_path,
                                                                    retriever_url):
    from agentgym.cli import main
    from trainers import train
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
