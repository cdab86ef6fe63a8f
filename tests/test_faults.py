"""The fault suite's services: real processes, real kills, and what a run does about each
(issue 33). Every test injects one fault into real components; the fakes are only the
fault itself or a scripted model output (``tests/fakes.py``).

Services a run starts or uses:
* the local retriever SIGKILLed in the middle of ``agentgym train env=search`` (a scripted
  policy that always searches): restarted by its supervisor on the same port, the hit
  episodes replayed, no infrastructure failure in any update's batch; with its restart
  budget spent the run stops with a checkpoint and a clear error;
* the retriever hung (SIGSTOP): health checks fail, it is replaced;
* a retriever the user started: not restarted, its outage counted;
* a sandbox worker SIGKILLed mid-execution: marked, replayed, not trained on;
* a Ray rollout worker SIGKILLed mid-rollout: replaced with the last weights, the step
  completes as an undisturbed one;
* an SGLang-API server (``agentgym serve``) behind a proxy that drops connections for 20 s:
  requests are retried until it answers, no trajectory lost;
* an SGLang server the engine launched itself, SIGKILLed after a weight push: restarted
  with the pushed weights.

The checkpoint faults (a kill during a save, a full disk, a damaged file, a cut metrics
line) are in tests/test_checkpoint_faults.py."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import socket
import threading

import httpx
import pytest
from conftest import wait_until
from fakes import SearchingEngine

import agentgym.tools.local_retriever as local_retriever
import agentgym.trainers.loop as loop
from agentgym.cli import main
from agentgym.rollout.engines.base import ENGINES
from agentgym.trainers.hooks import Hooks


# ---- services ---------------------------------------------------------------------------
class _RunEngine(SearchingEngine):
    """The engine a test's run builds: a :class:`SearchingEngine` calling the test's
    ``fault(k)`` before its k-th reply."""

    fault = None
    tokenizer = None  # the run's, once built

    @classmethod
    def from_config(cls, cfg, model, tokenizer):
        cls.tokenizer = tokenizer
        return cls(tokenizer, on_generate=cls.fault)


if "test-searching" not in ENGINES:
    ENGINES.register("test-searching", _RunEngine)


def _run_retriever() -> local_retriever.LocalRetriever:
    """The local retriever this process's run started (no ``retriever.url``)."""
    with local_retriever._servers_lock:
        servers = [s for s in local_retriever._servers.values() if s.alive]
    assert len(servers) == 1, servers
    return servers[0]


def _kill_and_wait_refused(server: local_retriever.LocalRetriever) -> None:
    """SIGKILL the server's process group; return once its port refuses connections."""
    port = int(server.url.rsplit(":", 1)[1])
    os.killpg(server.pid, signal.SIGKILL)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_until(refused, 60, f"the killed retriever's port {port} to refuse connections")


def _train(run, monkeypatch, kill_at: int, *extra: str) -> tuple[int, list[dict], list[str]]:
    """Train 3 steps (2 prompts x 2 samples, 2 turns each: 8 replies a step) with the
    retriever killed before reply ``kill_at``; the exit code, the metrics, and the text of
    every sequence each update trained on (read from the update's own batch)."""
    killed = []

    def fault(k: int) -> None:
        if k == kill_at:
            server = _run_retriever()
            killed.append(server.pid)
            _kill_and_wait_refused(server)

    monkeypatch.setattr(_RunEngine, "fault", staticmethod(fault))
    trained: list[str] = []
    update = loop.update_policy

    def recording_update(cfg, backend, batch, *args, **kwargs):
        tok = _RunEngine.tokenizer
        for ids, keep in zip(batch.input_ids, batch.attention_mask):
            trained.append(tok.decode(ids[keep.bool()].tolist()))
        return update(cfg, backend, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "update_policy", recording_update)
    local_retriever.stop_local_retrievers()  # this run starts (and owns) its own
    try:
        code = main(["train", "env=search", "model=tiny", "engine=test-searching",
                     f"run_dir={run}", "trainer.total_steps=3", "trainer.prompts_per_step=2",
                     "n=2", "rollout.max_turns=2", "rollout.max_tokens_per_turn=64",
                     "rollout.max_response_tokens=4096", "retriever.topk=1",
                     "trainer.eval_limit=0", "trainer.cold_start=off", *extra])
    finally:
        local_retriever.stop_local_retrievers()
    assert killed, "the fault was never injected"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return code, metrics, trained


def test_retriever_killed_mid_training_is_restarted_and_no_failed_episode_is_trained_on(
        tmp_path, monkeypatch):
    code, metrics, trained = _train(tmp_path / "run", monkeypatch, kill_at=9)
    assert code == 0
    # the updates' own batches: every sequence searched and got passages, none a failure
    assert len(trained) == 3 * 2 * 2
    assert all("<information>" in text for text in trained)
    assert not [text for text in trained if "Search failed" in text]
    steps = {m["step"]: m for m in metrics if "rollout/reward" in m}
    assert sorted(steps) == [1, 2, 3]
    # the kill came before step 2's first search: that episode (at least) failed, was
    # replayed once the supervisor had the retriever back, and nothing was dropped
    assert steps[1]["rollout/infra_failed"] == 0
    assert steps[2]["rollout/infra_failed"] >= 1
    assert all(m["rollout/infra_dropped"] == 0 for m in steps.values())
    assert [steps[k]["infra/restarts"] for k in (1, 2, 3)] == [0, 1, 1]
    assert steps[1]["infra/outage_s"] == 0 and steps[2]["infra/outage_s"] > 0


def test_retriever_out_of_restarts_stops_the_run_with_a_checkpoint(tmp_path, monkeypatch,
                                                                   capsys):
    run = tmp_path / "run"
    code, metrics, trained = _train(run, monkeypatch, 9, "retriever.max_restarts=0",
                                    "trainer.save_every=10")
    assert code == 1
    err = capsys.readouterr().err
    assert "restart budget is spent (0 restarts within 600 s)" in err
    assert "trainer.resume=auto" in err
    # step 2 rolled out against a dead retriever: its episodes failed, were replayed,
    # failed again and were dropped, so it trained on nothing; the run stopped after it
    steps = {m["step"]: m for m in metrics if "rollout/reward" in m}
    assert sorted(steps) == [1, 2]
    assert steps[2]["rollout/infra_dropped"] == 4
    assert len(trained) == 4  # step 1 only
    assert not [text for text in trained if "Search failed" in text]
    assert (run / "checkpoints" / "step_2" / "state.json").is_file()


def _kill_sandbox_worker_once(killed: list[int], stop: threading.Event) -> None:
    """Fault injection: SIGKILL the first sandboxed Python that runs code (a one-shot
    worker of this process's sandbox), from outside, as the host's OOM killer would."""
    import psutil
    me = psutil.Process()
    while not stop.is_set():
        for p in me.children(recursive=True):
            try:
                cmd = p.cmdline()
                if os.path.basename(cmd[0]).startswith("python") and cmd[-2:-1] == ["run"]:
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)
                    return
            except (psutil.Error, IndexError):
                continue
        stop.wait(0.01)  # poll interval


def test_sandbox_worker_killed_mid_execution_is_replayed_not_trained_on(tiny_tokenizer):
    from agentgym.config import RolloutConfig
    from agentgym.rollout.manager import GenerationManager
    from agentgym.envs.code import CodeEnv, code_row
    from fakes import ScriptedEngine
    from agentgym.tools.sandbox import Limits, LocalSandbox

    box = LocalSandbox(Limits(cpu_s=5.0, wall_s=60.0))
    code = "<code>\n```python\nimport time\ntime.sleep(2)\nprint(6 * 7)\n```\n</code>"
    engine = ScriptedEngine(tiny_tokenizer, [code, "<answer>\\boxed{42}</answer>"] * 2)
    mgr = GenerationManager(engine, tiny_tokenizer, lambda: CodeEnv(sandbox=box),
                            RolloutConfig())
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_sandbox_worker_once, args=(killed, stop))
    killer.start()
    try:
        traj = asyncio.run(mgr.play_one(code_row("what is 6 * 7?", "42"), uid="q0"))
    finally:
        stop.set()
        killer.join()
        mgr.close()
        box.close()
    assert len(killed) == 1
    # the first play's execution was killed: an infrastructure failure, so it was played
    # again; the trajectory returned is the second play's, whose code ran
    assert len(engine.produced) == 4
    assert traj.metrics["infra_retried"] == 1 and traj.metrics["infra_failures"] == 0
    obs = [tiny_tokenizer.decode(traj.token_ids[s.start:s.end]) for s in traj.segments
           if s.kind == "observation"]
    assert obs == ["\n<interpreter>\n42\n</interpreter>\n\n"]
    assert traj.reward == 1.0


def test_sglang_server_dropping_connections_for_20s_is_waited_out(tiny_path, tiny_tokenizer):
    from agentgym.rollout.engines.launcher import launch_serve
    from agentgym.rollout.engines.sglang import SGLangEngine
    from fakes import DroppingProxyFault
    from test_sglang_client import _talk_rollouts

    server = launch_serve(str(tiny_path))
    proxy = DroppingProxyFault(int(server.url.rsplit(":", 1)[1]))
    engine = SGLangEngine([proxy.url], tiny_tokenizer)  # the defaults: retries over 60 s
    try:
        assert len(_talk_rollouts(engine, tiny_tokenizer, rows=2)) == 4  # through the proxy
        proxy.drop_for(20.0)
        trajs = _talk_rollouts(engine, tiny_tokenizer, rows=4)
    finally:
        engine.close()
        proxy.close()
        server.stop()
    assert proxy.dropped >= 1 and engine.stats["retries"] >= 1
    assert len(trajs) == 8 and all(t.metrics["turns"] == 3 for t in trajs)


class _KillRolloutWorkerAtStep(Hooks):
    """Fault injection: when step ``at``'s rollout starts, SIGKILL the Ray rollout worker
    as soon as it is executing ``generate`` (Ray titles the process after its task)."""

    def __init__(self, at: int) -> None:
        self.at, self.rollouts, self.killed = at, 0, []
        self._thread: threading.Thread | None = None

    def phase(self, name: str, total: int) -> None:
        if name != "rollout":
            return
        self.rollouts += 1
        if self.rollouts == self.at:
            self._thread = threading.Thread(target=self._kill)
            self._thread.start()

    def _kill(self) -> None:
        import psutil

        def killed_one() -> bool:
            for p in psutil.process_iter(["cmdline"]):
                if any("RolloutWorker.generate" in part for part in p.info["cmdline"] or []):
                    p.send_signal(signal.SIGKILL)
                    self.killed.append(p.pid)
                    return True
            return False

        wait_until(killed_one, 120, "a rollout worker executing generate")

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def test_a_killed_ray_rollout_worker_is_replaced_and_the_step_completes(tmp_path,
                                                                        retriever_url):
    pytest.importorskip("ray")
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.trainers.loop import train

    def run(name: str, hooks: Hooks | None) -> list[dict]:
        cfg = build_config(parse_overrides([
            "env=search", "model=tiny", "trainer.total_steps=2", "trainer.prompts_per_step=2",
            "n=2", "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=256",
            "trainer.eval_limit=0", "trainer.cold_start=off", "ray.address=local",
            # an entropy bonus keeps every update running (the untrained model's rewards
            # are all zero), so the losses compared below exist
            "algo.entropy_coef=0.001", "trainer.lr=1e-3",
            "ray.rollout_workers=1", f"retriever.url={retriever_url}",
            f"run_dir={tmp_path / name}"]))
        train(cfg, hooks)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                .splitlines()]

    hooks = _KillRolloutWorkerAtStep(2)
    try:
        killed = run("killed", hooks)
    finally:
        hooks.join()
    assert len(hooks.killed) == 1
    assert [m["infra/restarts"] for m in killed] == [0, 1]
    # the replacement got the step-1 weights and the same prompts and seed: step 2 is
    # the step an undisturbed run takes
    assert killed[1]["rollout/policy_version"] == 1.0
    calm = run("calm", None)
    for a, b in zip(killed, calm):
        for key in ("rollout/reward", "rollout/response_length", "train/pg_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    import gzip
    import itertools

    from agentgym.core.paths import data_dir
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with gzip.open(data_dir() / "corpus" / "wiki_passages.jsonl.gz", "rt",
                   encoding="utf-8") as src:
        path.write_text("".join(itertools.islice(src, 200)), encoding="utf-8")
    return path


def test_a_hung_retriever_is_replaced_on_the_same_port(small_corpus, tmp_path):
    import psutil

    from agentgym.tools.retriever import RetrieverClient
    with local_retriever.LocalRetriever(small_corpus, index_dir=tmp_path / "ix") as r, \
            RetrieverClient(r.url, timeout=1.0, retries=0) as client:
        assert len(client.retrieve(["history"])[0]) == 3
        hung = r.pid
        os.kill(hung, signal.SIGSTOP)  # alive, but answers nothing: only health checks see it
        wait_until(lambda: r.pid != hung and r.supervisor.is_healthy(), 120,
                   "the supervisor to replace the hung retriever")
        assert len(client.retrieve(["history"])[0]) == 3  # the same URL serves again
        assert r.supervisor.outage.restarts == 1 and r.supervisor.outage.outage_s > 0
        assert not psutil.pid_exists(hung) or \
            psutil.Process(hung).status() == psutil.STATUS_ZOMBIE  # the hung one was killed


def test_a_users_service_is_not_restarted_but_its_outage_is_counted(small_corpus, tmp_path,
                                                                    caplog):
    from agentgym.supervision.supervisor import infra_totals, outage_for
    from agentgym.tools.errors import ToolUnavailable
    from agentgym.tools.retriever import RetrieverClient
    theirs = local_retriever.LocalRetriever(small_corpus, index_dir=tmp_path / "ix",
                                            supervise=False)  # as if the user started it
    url = theirs.start()
    try:
        client = RetrieverClient(url, retries=0)
        client.retrieve(["history"])
        before = infra_totals()
        server = theirs._server
        server.kill()
        with pytest.raises(ToolUnavailable):
            client.retrieve(["history"])
        assert outage_for(url).down  # reported by the client, not restarted by anyone
        assert "it was started outside AgentGym, so it is not restarted" in caplog.text
        assert not theirs.alive
        server.stop()
        server.start()  # the user brings it back, on the same port
        client.retrieve(["history"])
        after = infra_totals()
        assert not outage_for(url).down
        assert after["infra/restarts"] == before["infra/restarts"]
        assert after["infra/outage_s"] > before["infra/outage_s"]
        client.close()
    finally:
        theirs.stop()


def test_an_owned_server_killed_is_restarted_with_the_pushed_weights(tiny_path, tiny_model,
                                                                      tiny_tokenizer):
    """The servers an SGLang engine launched itself (``engine=sglang`` without urls) are
    supervised: one SIGKILLed after a weight push comes back on its port with those
    weights, and requests wait for it. ``agentgym serve`` stands in for SGLang here."""
    from agentgym.core.types import SamplingParams
    from agentgym.rollout.engines.launcher import launch_serve
    from agentgym.rollout.engines.sglang import SGLangEngine
    from engine_conformance import forward_logprobs, generate, perturbed

    server = launch_serve(str(tiny_path))
    engine = SGLangEngine([server.url], tiny_tokenizer, owned=[server], supervise=True)
    model = copy.deepcopy(tiny_model)
    try:
        new = perturbed(model, seed=7)
        model.load_state_dict(new)
        asyncio.run(engine.pause())
        engine.update_weights(new, 1)
        engine.resume()
        first = server.pid
        server.kill()  # SIGKILL: its weights v1 are gone with it
        prompt = tiny_tokenizer.encode("sync")
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        [out] = generate(engine, [prompt], greedy)  # waits while the server comes back
        wait_until(lambda: engine.supervisors[0].is_healthy(), 60, "the restart to settle")
        assert server.pid != first and engine.supervisors[0].outage.restarts == 1
        # answered by the restarted server with the pushed weights: the client checked its
        # weight_version, and the logprobs are the perturbed model's, not the initial one's
        assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "1"
        assert out.logprobs == pytest.approx(forward_logprobs(model, prompt, out.ids, 0.0),
                                             abs=1e-4)
        assert out.logprobs != pytest.approx(forward_logprobs(tiny_model, prompt, out.ids, 0.0),
                                             abs=1e-4)
    finally:
        engine.close()
    assert not server.alive
