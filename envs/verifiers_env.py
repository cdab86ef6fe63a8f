"""A verifiers environment as an env, unchanged: ``agentgym/Verifiers-v0`` (``env=verifiers``).

A verifiers (0.4) environment is a taskset of tasks whose ``@vf.reward`` methods (async,
weighted) score a rollout; a harness program plays each task against an OpenAI-compatible
endpoint (its model calls pass through verifiers' interception server), with the task's
tools served as MCP servers. AgentGym plays it the way prime-rl does, with AgentGym's
engine behind the endpoint:

* **verifiers runs in its own Python** (``verifiers.python``; ``make test`` builds
  ``.venv-verifiers``): its pins (``mcp==2.0.0``, ``openai<3``) cannot sit beside the
  project's (docs/decisions/envs.md, "Its own Python"). There
  :mod:`agentgym.tools.verifiers_worker` loads the
  environment as ``vf-eval`` does and plays the episodes it is asked for.
* **Each episode's model calls reach its own endpoint** on the rollout engine
  (:class:`agentgym.serving.agents.AgentManager`, as for ``env=agent``), which records the
  prompt ids, sampled ids and logprobs exactly as the engine saw them: the environment's
  responses and tool results enter the trajectory as the chat template renders them after
  the policy's own tokens, and the loss mask covers the sampled tokens only.
* **The reward is verifiers' own**: each ``@vf.reward`` awaited, its weight applied, summed
  (``Trace.reward``); the unweighted scores are in the trajectory's info (``rewards``).
  An episode verifiers reports as failed (its setup, its harness, a deadline:
  ``verifiers.timeout_s``) is counted (``agent/failed``) and not trained on.
* **Rows are the taskset's tasks** in ``load()`` order, the last ``verifiers.eval_size``
  held out (``data=test``, the run's step-0 and final evals); the prompt shown in a row is
  the task's, for reading: the harness program sends its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agentgym.envs.agent_program import AgentProgram, PlayedByProgram
from agentgym.envs.manifest import EnvManifest, config_value
from agentgym.tools.errors import MissingExtra

logger = logging.getLogger(__name__)

#: where ``make test`` builds the environment verifiers runs in (relative to the checkout)
DEFAULT_VENV = ".venv-verifiers"
WORKER = Path(__file__).resolve().parent.parent / "tools" / "verifiers_worker.py"


@dataclass
class VerifiersConfig:
    """``verifiers.*``: which environment, and the Python it runs in."""

    env: str = ""  # the taskset's id: an installed package (or one on verifiers.path)
    env_id: str = ""  # a verifiers Env to pair with it ("": the taskset's own, else single-agent)
    config: dict = field(default_factory=dict)  # the taskset's knobs (vf-eval's --env.taskset.*)
    harness: str = "null"  # the program that plays a task (verifiers' harness id)
    runtime: str = "subprocess"  # where it runs (verifiers' runtime type)
    python: str = ""  # an interpreter with verifiers ("": this one, else .venv-verifiers's)
    path: str = "."  # import paths for the taskset, os.pathsep-separated (relative: to the cwd)
    eval_size: int = 0  # the last K tasks held out (data=test); 0: a fifth of them
    timeout_s: float = 600.0  # one episode, setup to score
    startup_timeout_s: float = 600.0  # the worker's start (imports, the taskset's load())

    def __post_init__(self) -> None:
        if self.eval_size < 0:
            raise ValueError(f"verifiers.eval_size must be >= 0, got {self.eval_size}")
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"verifiers.{name} must be > 0, got {getattr(self, name)}")
        if not isinstance(self.config, dict):
            raise ValueError(f"verifiers.config={self.config!r} must be a mapping of the "
                             f"taskset's knobs, e.g. {{num_tasks: 100}}")

    def interpreter(self) -> str:
        """The Python verifiers runs in (see :attr:`python`)."""
        if self.python:
            if not Path(self.python).exists():
                raise FileNotFoundError(f"verifiers.python={self.python!r} does not exist")
            return self.python
        try:
            import verifiers.v1  # noqa: F401
            return sys.executable
        except ImportError:
            pass
        venv = Path(DEFAULT_VENV) / "bin" / "python"
        if venv.exists():
            return str(venv)
        raise MissingExtra(
            "env=verifiers needs verifiers (0.4, Python >= 3.11) in an environment of its own: "
            f"`make {DEFAULT_VENV}` builds {DEFAULT_VENV}/ here (make test does too), or give "
            "verifiers.python=/path/to/python of one where `pip install verifiers` ran")

    def spec(self) -> dict:
        if not self.env:
            raise ValueError("env=verifiers needs verifiers.env=TASKSET_ID: an installed "
                             "verifiers taskset package, or a module on verifiers.path")
        paths = [str(Path(p).resolve()) for p in self.path.split(os.pathsep) if p]
        return {"taskset": self.env, "env_id": self.env_id, "config": self.config,
                "harness": self.harness, "runtime": self.runtime, "path": paths,
                "timeout_s": self.timeout_s}


class WorkerDied(RuntimeError):
    """The verifiers worker process ended; its requests in flight fail with this."""


class VerifiersWorker:
    """The worker process (:mod:`agentgym.tools.verifiers_worker`) and its JSON-lines
    protocol: :meth:`request` from any thread, :meth:`arequest` from a coroutine; a
    reader thread hands each reply to its request and the worker's stderr to the log."""

    def __init__(self, cfg: VerifiersConfig) -> None:
        self.cfg = cfg
        #: the episodes' working folders (removed with the worker, however it ends)
        self.workdirs = tempfile.mkdtemp(prefix="agentgym-verifiers-")
        cmd = [cfg.interpreter(), str(WORKER),
               json.dumps({**cfg.spec(), "workdirs": self.workdirs})]
        logger.info("starting the verifiers worker: %s", shlex.join(cmd[:2]))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     start_new_session=True)
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True, name="verifiers-worker").start()
        threading.Thread(target=self._log, daemon=True, name="verifiers-worker-log").start()
        try:
            hello = self._ready.result(timeout=cfg.startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise TimeoutError(f"the verifiers worker for {cfg.env!r} did not start within "
                               f"verifiers.startup_timeout_s={cfg.startup_timeout_s:g}") from None
        if not hello.get("ready"):
            self.close()
            raise ValueError(f"verifiers.env={cfg.env!r} did not load: {hello.get('error')}"
                             f"{self._tail()}")
        self.n_tasks = int(hello["tasks"])

    def _tail(self) -> str:
        tail = "".join(self._stderr[-12:]).strip()
        return f"\n(the worker's last words:)\n{tail}" if tail else ""

    def _log(self) -> None:
        for line in self.proc.stderr:
            self._stderr = self._stderr[-200:] + [line]
            logger.debug("verifiers: %s", line.rstrip())

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("verifiers worker wrote a line that is not JSON: %r", line[:200])
                continue
            if "rid" not in msg:
                if not self._ready.done():
                    self._ready.set_result(msg)
                continue
            with self._lock:
                fut = self._pending.pop(msg["rid"], None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        self.proc.wait()
        err = WorkerDied(f"the verifiers worker exited ({self.proc.returncode}){self._tail()}")
        if not self._ready.done():
            self._ready.set_result({"ready": False, "error": str(err)})
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        shutil.rmtree(self.workdirs, ignore_errors=True)  # what its episodes left

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def submit(self, op: str, **fields) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(WorkerDied(f"the verifiers worker has exited{self._tail()}"))
            return fut
        rid = next(self._ids)
        with self._lock:
            self._pending[rid] = fut
        try:
            self.proc.stdin.write(json.dumps({"op": op, "rid": rid, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            with self._lock:
                self._pending.pop(rid, None)
            fut.set_exception(WorkerDied(f"the verifiers worker has exited: {e}"))
        return fut

    def request(self, op: str, timeout: float | None = None, **fields) -> dict:
        return _answer(self.submit(op, **fields).result(timeout=timeout))

    async def arequest(self, op: str, **fields) -> dict:
        return _answer(await asyncio.wrap_future(self.submit(op, **fields)))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:  # it and what it started
            import signal
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        shutil.rmtree(self.workdirs, ignore_errors=True)


def _answer(msg: dict) -> dict:
    if "error" in msg:
        raise RuntimeError(msg["error"])
    return msg


class VerifiersProgram:
    """What plays ``env=verifiers``'s episodes for the agent manager: ``play(row,
    base_url)`` asks the worker for one episode of the row's task against that endpoint
    and returns verifiers' reward (raising, so the episode is not trained on, when
    verifiers reports the episode failed)."""

    def __init__(self, cfg) -> None:
        self.cfg: VerifiersConfig = config_value(cfg, "verifiers")
        self.model = cfg.model
        self._worker: VerifiersWorker | None = None
        self._lock = threading.Lock()

    def worker(self) -> VerifiersWorker:
        with self._lock:
            if self._worker is None or not self._worker.alive:
                if self._worker is not None:
                    logger.warning("the verifiers worker died; starting another")
                self._worker = VerifiersWorker(self.cfg)
            return self._worker

    async def play(self, row: dict, base_url: str) -> float:
        idx = int(row["extra_info"]["task"])
        loop = asyncio.get_running_loop()
        worker = await loop.run_in_executor(None, self.worker)
        out = await worker.arequest("episode", idx=idx, base_url=base_url,
                                    model=str(self.model))
        if not out["rewards"] and (not out["ok"] or out["errors"]):
            raise RuntimeError("verifiers reports the episode failed: " +
                               "; ".join(out["errors"] or ["(no error given)"]))
        return float(out["reward"])

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None


class VerifiersEnv(AgentProgram, env_id="agentgym/Verifiers-v0", short="verifiers"):
    """Stands for ``env=verifiers`` in the registry: its episodes are played by verifiers'
    own harness against the rollout engine (:class:`VerifiersProgram`), not stepped here."""

    def __init__(self, max_turns: int | None = None) -> None:
        raise PlayedByProgram("env=verifiers is played by the verifiers environment's own "
                              "harness (envs/verifiers_env.py); it is not an env to step")


# -- what the trainer asks of it (envs.manifest) ------------------------------------------
def task_rows(verifiers: VerifiersConfig, split: str = "train") -> list[dict]:
    """The taskset's tasks as rows: the last ``eval_size`` are ``test``, the rest
    ``train``."""
    return _split(verifiers, _tasks(verifiers)["tasks"], split)


def _split(verifiers: VerifiersConfig, tasks: list[dict], split: str) -> list[dict]:
    if len(tasks) < 2:
        raise ValueError(f"verifiers.env={verifiers.env!r} has {len(tasks)} task(s); training "
                         f"and a held-out set need at least 2")
    held = verifiers.eval_size or max(1, len(tasks) // 5)
    if held >= len(tasks):
        raise ValueError(f"verifiers.eval_size={held} leaves no training task of "
                         f"{len(tasks)}; give one below {len(tasks)}")
    chosen = tasks[:len(tasks) - held] if split == "train" else tasks[len(tasks) - held:]
    return [_row(verifiers.env, t, split) for t in chosen]


def _tasks(verifiers: VerifiersConfig) -> dict:
    """The taskset's tasks and rubric, loaded once per process and config (a run asks for
    its training and its held-out rows)."""
    return _tasks_of(json.dumps({**verifiers.spec(), "python": verifiers.interpreter(),
                                 "startup_timeout_s": verifiers.startup_timeout_s},
                                sort_keys=True))


@functools.lru_cache(maxsize=8)
def _tasks_of(key: str) -> dict:
    spec = json.loads(key)
    cfg = VerifiersConfig(env=spec["taskset"], env_id=spec["env_id"], config=spec["config"],
                          harness=spec["harness"], runtime=spec["runtime"],
                          python=spec["python"], path=os.pathsep.join(spec["path"]),
                          timeout_s=spec["timeout_s"],
                          startup_timeout_s=spec["startup_timeout_s"])
    worker = VerifiersWorker(cfg)
    try:
        return worker.request("tasks", timeout=cfg.startup_timeout_s)
    finally:
        worker.close()


def check(verifiers: VerifiersConfig) -> str:
    """``agentgym check-env verifiers verifiers.env=ID``: the taskset loads in its worker,
    holds training and held-out tasks, and has a rubric; what it found, in words."""
    if not verifiers.env:
        raise PlayedByProgram("give verifiers.env=TASKSET_ID (and verifiers.path=DIR when "
                              "it is not installed) to check a verifiers environment")
    found = _tasks(verifiers)
    train, test = (_split(verifiers, found["tasks"], s) for s in ("train", "test"))
    if not found["rewards"]:
        raise ValueError(f"verifiers.env={verifiers.env!r}: its task type has no @vf.reward "
                         f"method, so every episode's reward would be 0")
    rubric = ", ".join(f"{r['name']} x {r['weight']:g}" for r in found["rewards"])
    return (f"{verifiers.env}: {len(found['tasks'])} tasks ({len(train)} train, "
            f"{len(test)} held out), rubric {rubric}")


def heldout_task_rows(verifiers: VerifiersConfig) -> list[dict]:
    return task_rows(verifiers, "test")


def _row(name: str, task: dict, split: str) -> dict:
    prompt = task["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        list(prompt or [])
    if task.get("system_prompt"):
        messages = [{"role": "system", "content": task["system_prompt"]}, *messages]
    data = task.get("data") or {}
    answer = data.get("answer")
    return {"data_source": f"verifiers/{name}", "prompt": messages, "env": "verifiers",
            "reward_model": {"style": "env",
                             "ground_truth": answer if isinstance(answer, str) else ""},
            "extra_info": {"task": task["idx"], "index": task["idx"],
                           "id": f"verifiers-{name}-{task['idx']}"}}


MANIFEST = EnvManifest(
    sections={"verifiers": VerifiersConfig},
    presets={"trainer.eval_data": "test", "data.answerable_only": False,
             "trainer.cold_start": "off"},
    datasets={"train": task_rows, "test": heldout_task_rows},
    played_by_program=True,
    program="agentgym.envs.verifiers_env:VerifiersProgram",
    check=check,
    sources=lambda verifiers: {"env": verifiers.env, "config": verifiers.config},
)
