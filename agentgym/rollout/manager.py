"""Multi-turn generation manager: one asyncio task per trajectory, no lockstep.

Each trajectory loops: generate (the engine batches concurrent requests) → ``env.step``
in a thread pool (a slow tool never blocks the event loop or other trajectories) →
append the observation tokens once, with mask 0 → … until the env terminates or
truncates, or the token budget runs out (then ``truncated``).

Masking rule, applied here and nowhere else: sampled ids go in as ``generated``
segments (mask 1, with the engine's logprobs); prompt, observation and filler ids go in
with mask 0 (see :class:`agentgym.core.types.Trajectory`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import itertools
import logging
import time
from typing import Any, Callable

from agentgym.rollout.chat import ChatTokens
from agentgym.config import RolloutConfig
from agentgym.rollout.engines.base import Engine
from agentgym.core.supervisor import wait_healthy
from agentgym.core.types import SamplingParams, Trajectory

logger = logging.getLogger(__name__)

#: how long a replay waits for the local services to be healthy again (a restart takes
#: seconds; a supervisor that gives up ends the wait at once)
INFRA_WAIT_S = 120.0


def trajectory_seed(base: int, uid: str, sample_index: int) -> int:
    """A stable per-trajectory seed, independent of scheduling order."""
    h = hashlib.sha256(f"{base}/{uid}/{sample_index}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def row_uid(row: dict, index: int) -> str:
    extra = row.get("extra_info") or {}
    return str(extra.get("id") or extra.get("index", index))


class GenerationManager:
    """Runs rollouts of an env against an engine.

    Args:
        engine: a token-in/token-out :class:`~agentgym.rollout.engines.base.Engine`.
        tokenizer: the policy's tokenizer (chat template, observation tokens).
        env_factory: returns a fresh environment; one per trajectory.
        cfg: budgets, sampling and concurrency.
        seed: base seed; each trajectory's sampling seed derives from it.
    """

    def __init__(self, engine: Engine, tokenizer, env_factory: Callable[[], Any],
                 cfg: RolloutConfig, seed: int = 0, allow_weight_updates: bool = False) -> None:
        self.engine = engine
        self.chat = ChatTokens(tokenizer)
        self.env_factory = env_factory
        self.cfg = cfg
        self.seed = seed
        #: asynchronous training: a weight update may land between the turns of an
        #: episode; each turn records its version (else such an update is an error)
        self.allow_weight_updates = allow_weight_updates
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.env_workers,
                                                           thread_name_prefix="env")
        self._sessions = itertools.count()

    async def _in_pool(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def rollout(self, row: dict, uid: str = "0", sample_index: int = 0,
                      base_seed: int | None = None) -> Trajectory:
        """Play one episode of ``row``; return its trajectory. ``base_seed`` overrides the
        manager's ``seed`` for this episode.

        An episode a tool failure of the infrastructure's marked (``metrics
        ["infra_failures"] > 0``, the reason in ``info["infra_error"]``) is, with
        ``rollout.on_infra_error=retry``, played once more with the same seed when the
        local services are healthy again (``metrics["infra_retried"] = 1``); whether a
        still-marked episode is trained on is the trainer's choice (``trainers.sampling``).
        """
        traj = await self._play(row, uid, sample_index, base_seed)
        if traj.metrics["infra_failures"] and self.cfg.on_infra_error == "retry":
            logger.warning("episode %s/%d hit an infrastructure failure (%s); replaying it "
                           "once the services answer", uid, sample_index,
                           traj.info.get("infra_error", "?"))
            await asyncio.to_thread(wait_healthy, INFRA_WAIT_S)  # not an env worker's time
            traj = await self._play(row, uid, sample_index, base_seed)
            traj.metrics["infra_retried"] = 1.0
        return traj

    def _tokens_per_turn(self, row: dict) -> int:
        """One action's token budget: the row's env's own in a mixed run, else the run's."""
        own = getattr(self.env_factory, "tokens_per_turn", None)
        return (own(row) if own else None) or self.cfg.max_tokens_per_turn

    async def _play(self, row: dict, uid: str, sample_index: int,
                    base_seed: int | None) -> Trajectory:
        cfg = self.cfg
        seed = trajectory_seed(self.seed if base_seed is None else base_seed, uid, sample_index)
        session = f"{uid}/{sample_index}/{seed}/{next(self._sessions)}"  # one per episode
        traj = Trajectory(uid=uid, sample_index=sample_index,
                          data_source=str(row.get("data_source", "")))
        m = {"turns": 0, "generate_s": 0.0, "env_s": 0.0, "length_stops": 0}
        env = await self._in_pool(self.env_factory, row) \
            if getattr(self.env_factory, "takes_row", False) \
            else await self._in_pool(self.env_factory)
        try:
            t0 = time.perf_counter()
            obs, info = await self._in_pool(env.reset, seed=seed, options={"row": row})
            m["env_s"] += time.perf_counter() - t0
            fmt = env.observation_format
            prompt, traj.images = self.chat.prompt(obs, tools=getattr(env, "tools", None))
            if len(prompt) > cfg.max_prompt_tokens:
                raise ValueError(f"prompt of row {uid!r} has {len(prompt)} tokens, more than "
                                 f"rollout.max_prompt_tokens={cfg.max_prompt_tokens}")
            traj.append("prompt", prompt, turn=0)
            traj.policy_version = self.engine.policy_version
            for turn in itertools.count():
                budget = cfg.max_response_tokens - traj.response_length
                if budget <= 0:
                    traj.truncated, info = True, {**info, "end": "token_budget"}
                    break
                sampling = SamplingParams(
                    max_new_tokens=min(self._tokens_per_turn(row), budget),
                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                    stop=env.stop_strings, seed=(seed + 7919 * turn) % 2**31)
                t0 = time.perf_counter()
                out = await self.engine.generate(traj.token_ids, sampling, images=traj.images,
                                                 session_id=session)
                m["generate_s"] += time.perf_counter() - t0
                version = out.policy_version if out.policy_version is not None \
                    else self.engine.policy_version
                if version != traj.policy_version and not self.allow_weight_updates:
                    raise RuntimeError("policy weights changed inside a trajectory; "
                                       "pause() the engine between rollouts")
                traj.turn_versions.append(version)
                traj.append("generated", out.ids, turn, out.logprobs)
                m["turns"] += 1
                m["length_stops"] += out.finish_reason == "length"
                text = self.chat.decode(out.ids)
                t0 = time.perf_counter()
                obs, reward, terminated, truncated, info = await self._in_pool(env.step, text)
                m["env_s"] += time.perf_counter() - t0
                traj.step_rewards.append(reward)
                if terminated or truncated:
                    traj.terminated, traj.truncated = terminated, truncated
                    break
                filler, obs_ids = self.chat.after_action_ids(out.ids, obs, fmt)
                if traj.response_length + len(filler) + len(obs_ids) >= cfg.max_response_tokens:
                    traj.truncated, info = True, {**info, "end": "token_budget"}
                    break
                traj.append("filler", filler, turn)
                traj.append("observation", obs_ids, turn)
        finally:
            await self._in_pool(env.close)
        if traj.turn_versions:
            traj.policy_version = min(traj.turn_versions)
        traj.reward = float(sum(traj.step_rewards))
        traj.info = {k: v for k, v in info.items() if _jsonable(v)}
        traj.info.setdefault("env", str(row.get("env", "")))  # per-env metrics of mixed runs
        traj.metrics = {
            **{k: float(v) for k, v in m.items()},
            "tool_calls": float(info.get("tool_calls", 0)),
            "tool_failures": float(info.get("tool_failures", 0)),
            "malformed_actions": float(info.get("malformed_actions", 0)),
            "infra_failures": float(info.get("infra_failures", 0)),
            "infra_retried": 0.0,
            "prompt_length": float(traj.prompt_length),
            "response_length": float(traj.response_length),
            "generated_tokens": float(traj.num_sampled),
            "observation_tokens": float(sum(len(s) for s in traj.segments
                                            if s.kind in ("observation", "filler"))),
        }
        traj.check()
        return traj

    async def run(self, rows: list[dict], n: int | None = None,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Roll out ``n`` samples of every row concurrently (at most ``max_concurrency``
        in flight); results keep the order ``(row, sample)``."""
        n = n or self.cfg.n
        gate = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(i: int, row: dict, k: int) -> Trajectory:
            async with gate:
                traj = await self.rollout(row, row_uid(row, i), k)
            if on_done is not None:
                on_done(traj)
            return traj

        tasks = [one(i, row, k) for i, row in enumerate(rows) for k in range(n)]
        return list(await asyncio.gather(*tasks))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (
        isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v))


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean metrics over trajectories (reward, em, f1, turns, lengths, tool counters)."""
    if not trajs:
        return {}
    out: dict[str, float] = {"count": float(len(trajs))}
    out["reward"] = sum(t.reward for t in trajs) / len(trajs)
    for key in ("em", "f1"):
        out[key] = sum(float(t.info.get(key, 0.0)) for t in trajs) / len(trajs)
    if any("answer_seen" in t.info for t in trajs):  # search: a result held a gold answer
        out["answer_seen"] = sum(float(t.info.get("answer_seen", 0)) for t in trajs) / len(trajs)
    out["answered"] = sum(t.terminated for t in trajs) / len(trajs)
    out["format_valid"] = sum(t.terminated and t.metrics["malformed_actions"] == 0
                              for t in trajs) / len(trajs)
    out["truncated"] = sum(t.truncated for t in trajs) / len(trajs)
    for key in trajs[0].metrics:
        out[key] = sum(t.metrics[key] for t in trajs) / len(trajs)
    return out
