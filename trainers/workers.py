"""Where episodes are played, in the trainer's process: :class:`LocalWorkers` (an engine
and a generation manager; Ray puts the same in actors, :class:`~agentgym.trainers.
ray_cluster.RayWorkers`), and the held-out eval's metrics."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading

from agentgym.config import Config, is_mixed
from agentgym.rollout.manager import GenerationManager, summarize
from agentgym.rollout.runtime import env_factory, played_by_program
from agentgym.trainers.hooks import Hooks
from agentgym.rollout.engines.base import push_weights

logger = logging.getLogger(__name__)


async def rollouts(manager: GenerationManager, rows: list[dict], n: int, hooks: Hooks):
    hooks.phase("rollout", len(rows) * n)
    return await manager.run(rows, n=n, on_done=lambda _t: hooks.advance())


def split_by_env(trajs: list) -> dict[str, list]:
    """Trajectories by the env that played them (``info["env"]``), in first-seen order."""
    out: dict[str, list] = {}
    for t in trajs:
        out.setdefault(str(t.info.get("env", "")), []).append(t)
    return out


def eval_metrics(trajs: list, per_env: bool = False) -> dict:
    """``eval/*`` over ``trajs``; a mixed run's also env by env (``search/eval/em``, ...)."""
    s = summarize(trajs)
    m = {"eval/em": s["em"], "eval/f1": s["f1"], "eval/format_valid": s["format_valid"],
         "eval/count": s["count"], "eval/tool_calls": s["tool_calls"]}
    if per_env:
        for env, part in split_by_env(trajs).items():
            m.update({f"{env}/{k}": v for k, v in eval_metrics(part).items()})
    return m


def evaluate(cfg: Config, engine, tokenizer, rows: list[dict], hooks: Hooks) -> dict:
    """Greedy single-sample accuracy on ``rows`` (the same env, budgets and tools)."""
    workers = LocalWorkers(cfg, engine, tokenizer)
    try:
        return eval_metrics(workers.generate(rows, 1, cfg.trainer.seed, hooks, greedy=True),
                            per_env=is_mixed(cfg))
    finally:
        workers.close(engine_too=False)


class LocalWorkers:
    """Rollouts in this process: the engine and a generation manager (the default; Ray
    puts the same in actors, :mod:`agentgym.trainers.ray_cluster`).

    ``generate(rows, n, seed, hooks, greedy)`` plays ``n`` samples of every row (greedy:
    temperature 0, one sample; the eval mode); ``update_weights(state_dict, version)``
    swaps the engine's weights with generation paused.
    """

    def __init__(self, cfg: Config, engine, tokenizer) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self._managers: dict = {}  # greedy (bool) or "async" -> manager
        self._managers_lock = threading.Lock()  # run_group may run in several actor threads
        #: the engine's weights live in servers (which may hold anything at start)
        self.remote = not engine.needs_model

    def _manager(self, greedy: bool) -> GenerationManager:
        if greedy not in self._managers:
            cfg = self.cfg
            if greedy:
                cfg = copy.deepcopy(cfg)
                cfg.rollout = dataclasses.replace(cfg.rollout, temperature=0.0, n=1)
            if played_by_program(cfg):  # the user's agent program plays the rows
                from agentgym.serving.agents import AgentManager  # lazy: loads fastapi
                self._managers[greedy] = AgentManager(self.engine, self.tokenizer, cfg,
                                                      seed=cfg.trainer.seed, greedy=greedy)
            else:
                self._managers[greedy] = GenerationManager(self.engine, self.tokenizer,
                                                           env_factory(cfg), cfg.rollout,
                                                           seed=cfg.trainer.seed,
                                                           deadlines=cfg.deadlines)
        return self._managers[greedy]

    def extra_metrics(self) -> dict:
        """The sampling manager's own step metrics (an agent run's ``agent/*``) and, with
        ``rollout.partial``, how many requests weight updates have interrupted so far
        (``engine/preempted``)."""
        out: dict = {}
        for manager in (self._managers.get(False), self._managers.get("async")):
            take = getattr(manager, "take_stats", None)
            out.update(take() if take else {})
        stats = getattr(self.engine, "stats", None)
        if self.cfg.rollout.partial and isinstance(stats, dict) and "preempted" in stats:
            out["engine/preempted"] = float(stats["preempted"])
        return out

    def generate(self, rows: list[dict], n: int, seed: int, hooks: Hooks,
                 greedy: bool = False) -> list:
        manager = self._manager(greedy)
        manager.seed = seed
        return self.engine.run(rollouts(manager, rows, n, hooks))

    async def run_group(self, row: dict, uid: str, n: int, seed: int) -> list:
        """``n`` samples of one row with base seed ``seed`` (asynchronous training: may run
        across weight updates, each turn tagged with its version)."""
        with self._managers_lock:
            if "async" not in self._managers and played_by_program(self.cfg):
                from agentgym.serving.agents import AgentManager  # turns record versions
                self._managers["async"] = AgentManager(self.engine, self.tokenizer, self.cfg,
                                                       seed=self.cfg.trainer.seed)
            elif "async" not in self._managers:
                self._managers["async"] = GenerationManager(
                    self.engine, self.tokenizer, env_factory(self.cfg), self.cfg.rollout,
                    seed=self.cfg.trainer.seed, allow_weight_updates=True,
                    deadlines=self.cfg.deadlines)
            manager = self._managers["async"]
        done = await asyncio.gather(*(manager.play(row, uid, k, base_seed=seed)
                                      for k in range(n)))
        return [t for parts in done for t in parts]

    def update_weights(self, state_dict: dict, version: int) -> None:
        push_weights(self.engine, state_dict, version, partial=self.cfg.rollout.partial)

    def close(self, engine_too: bool = True) -> None:
        for manager in self._managers.values():
            manager.close()
        self._managers = {}
        if engine_too:
            self.engine.close()
