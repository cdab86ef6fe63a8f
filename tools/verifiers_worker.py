"""A verifiers environment's side of ``env=verifiers`` (:mod:`agentgym.envs.verifiers_env`).

Run by the interpreter of an environment that has ``verifiers`` (its pins cannot sit beside
the project's: docs/decisions/envs.md, "Its own Python"), as
``python verifiers_worker.py CONFIG_JSON``: it
imports nothing of AgentGym. It loads the environment as ``vf-eval`` does
(``resolve_env_config`` → ``load_environment``, its serving resources up once: shared tool
servers, the interception server) and answers JSON lines on stdin, one JSON line each on
stdout (logs go to stderr):

* ``{"op": "tasks", "rid": R}`` → ``{"rid": R, "tasks": [{"idx", "prompt", "data"}, …],
  "rewards": [{"name", "weight"}, …]}``: the taskset's tasks in ``load()`` order (``data``
  is the task's wire data) and the rubric's reward functions;
* ``{"op": "episode", "rid": R, "idx": I, "base_url": U, "model": M}`` → one episode of
  task ``I`` played by the model at ``U`` (OpenAI's API: AgentGym's per-episode endpoint,
  which records the exact tokens), answered ``{"rid": R, "reward", "rewards", "metrics",
  "ok", "errors"}`` when it ends: the reward is the rubric's (each ``@vf.reward`` awaited,
  its weight applied, summed by verifiers' own ``Trace.reward``), averaged over the
  episode's trainable traces. Episodes run concurrently, each in its own asyncio task.
* ``{"op": "close"}`` (or end of input): the serving resources go down and it exits.

A failure of one request is its answer (``{"rid": R, "error": "..."}``), not the worker's
end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import traceback

logger = logging.getLogger("agentgym.verifiers_worker")


def env_config(spec: dict):
    """The run's verifiers EnvConfig: the taskset and its knobs, each agent's harness and
    a local runtime (``vf-eval``'s defaults would run a remote sandbox)."""
    from verifiers.v1.utils.loaders import resolve_env_config
    agent = {"runtime": {"type": spec.get("runtime") or "subprocess"}}
    if spec.get("harness"):
        agent["harness"] = {"id": spec["harness"]}
    raw = {"taskset": {"id": spec["taskset"], **(spec.get("config") or {})}, "agent": agent}
    if spec.get("env_id"):
        raw["id"] = spec["env_id"]
    return resolve_env_config(raw)


class Worker:
    def __init__(self, spec: dict) -> None:
        from verifiers.v1.utils.loaders import load_environment
        self.spec = spec
        self.env = load_environment(env_config(spec))
        self.tasks = list(self.env.taskset)
        self.out_lock = asyncio.Lock()
        self.out, self.inp = _protocol_pipes()

    async def reply(self, msg: dict) -> None:
        line = json.dumps(msg, default=str) + "\n"
        async with self.out_lock:
            self.out.write(line)
            self.out.flush()

    def task_rows(self) -> list[dict]:
        rows = []
        for i, task in enumerate(self.tasks):
            data = task.data
            prompt = data.prompt
            if not isinstance(prompt, (str, type(None))):
                prompt = [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                          for m in prompt]
            rows.append({"idx": i, "prompt": prompt, "system_prompt": data.system_prompt,
                         "data": data.model_dump(mode="json")})
        return rows

    def rubric(self) -> list[dict]:
        """The task type's ``@vf.reward`` functions and their weights, as verifiers finds
        them (its own discovery, on the first task)."""
        from verifiers.v1.utils.decorators import discover_decorated
        if not self.tasks:
            return []
        return [{"name": fn.__name__, "weight": float(getattr(fn, "_vf_weight", 1.0))}
                for fn in discover_decorated(self.tasks[0], "reward")]

    async def episode(self, req: dict) -> dict:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig
        idx = int(req["idx"])
        if not 0 <= idx < len(self.tasks):
            raise IndexError(f"task {idx}: the taskset has {len(self.tasks)} tasks "
                             f"(0 .. {len(self.tasks) - 1})")
        ctx = ModelContext(model=req.get("model") or "agentgym-policy",
                           client=EvalClientConfig(base_url=req["base_url"],
                                                   api_key_var="AGENTGYM_EPISODE_KEY"))
        deadline = self.spec.get("timeout_s")
        try:
            async with asyncio.timeout(deadline):
                episode = await self.env.run_episode(self.tasks[idx], ctx)
        except TimeoutError:
            raise TimeoutError(f"task {idx}'s episode ran past verifiers.timeout_s="
                               f"{deadline:g}") from None
        traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)] or \
            list(episode.traces)
        rewards: dict[str, float] = {}
        metrics: dict[str, float] = {}
        for t in traces:
            for name, r in t.rewards.items():
                if r is not None:
                    rewards[name] = rewards.get(name, 0.0) + r.score / len(traces)
            for name, m in (getattr(t, "metrics", None) or {}).items():
                if isinstance(m, (int, float)):
                    metrics[name] = metrics.get(name, 0.0) + float(m) / len(traces)
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        for t in traces:
            errors += [f"{e.type}: {e.message}" for e in (getattr(t, "errors", None) or [])]
        reward = sum(t.reward for t in traces) / len(traces) if traces else 0.0
        return {"reward": reward, "rewards": rewards, "metrics": metrics,
                "ok": bool(episode.ok), "errors": errors}

    async def handle(self, req: dict) -> None:
        rid = req.get("rid")
        try:
            if req.get("op") == "tasks":
                result = {"tasks": self.task_rows(), "rewards": self.rubric()}
            elif req.get("op") == "episode":
                result = await self.episode(req)
            else:
                raise ValueError(f"op={req.get('op')!r}: tasks, episode or close")
            await self.reply({"rid": rid, **result})
        except Exception as e:  # the request's failure is its answer
            logger.warning("request %s failed: %s", rid, traceback.format_exc())
            await self.reply({"rid": rid, "error": f"{type(e).__name__}: {e}"})

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), self.inp)
        running: set[asyncio.Task] = set()
        async with self.env.serving():
            await self.reply({"ready": True, "tasks": len(self.tasks)})
            while line := await reader.readline():
                req = json.loads(line)
                if req.get("op") == "close":
                    break
                task = asyncio.create_task(self.handle(req))
                running.add(task)
                task.add_done_callback(running.discard)
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


_PIPES: tuple | None = None


def _protocol_pipes():
    """The protocol's own copies of stdin and stdout; fds 0 and 1 become /dev/null and
    stderr, so the processes verifiers starts (harness programs, tool servers) neither
    read the requests nor write into the replies."""
    global _PIPES
    if _PIPES is None:
        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w", buffering=1)
        inp = os.fdopen(os.dup(0), "rb", buffering=0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        _PIPES = (out, inp)
    return _PIPES


def _remove_port_files() -> None:
    """verifiers 0.4.0 has each tool server it starts write its port to
    ``/tmp/vf-port-<uuid>`` and never removes the file (one per episode's tool server):
    with the subprocess runtime the file is this machine's, so it is removed once read."""
    import verifiers.v1.mcp.launch as vf_launch
    read_back = vf_launch._read_back_port

    async def read_then_remove(runtime, path: str) -> int:
        try:
            return await read_back(runtime, path)
        finally:
            if getattr(runtime, "type", None) == "subprocess":
                try:
                    os.unlink(path)
                except OSError:
                    pass
    vf_launch._read_back_port = read_then_remove


def main() -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _protocol_pipes()
    spec = json.loads(sys.argv[1])
    paths = [os.path.abspath(p) for p in spec.get("path") or []]
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    # verifiers starts the taskset's tool servers as processes that import it too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    # the harness programs are PEP 723 scripts verifiers runs with uv: this env's uv first
    bindir = os.path.dirname(sys.executable)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("AGENTGYM_EPISODE_KEY", "agentgym")
    if spec.get("workdirs"):  # the episodes' working folders (verifiers' subprocess runtime
        # makes them under ~/.cache/verifiers) in a folder the parent removes however this
        # process ends: a killed worker cannot remove its own (verifiers 0.4.0's module
        # constant, read when a runtime starts)
        import pathlib

        import verifiers.v1.runtimes.subprocess as vf_subprocess
        vf_subprocess.CACHE_DIR = pathlib.Path(spec["workdirs"])
    _remove_port_files()
    try:
        worker = Worker(spec)
    except Exception as e:  # a taskset that does not load: said on stdout, then exit 2
        out, _ = _protocol_pipes()
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
        raise SystemExit(2) from e
    asyncio.run(worker.serve())


if __name__ == "__main__":
    main()
