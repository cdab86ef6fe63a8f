"""Multi-turn generation manager: one asyncio task per trajectory, no lockstep.

Each trajectory loops: generate (the engine batches concurrent requests) → ``env.step``
in a thread pool (a slow tool never blocks the event loop or other trajectories) →
append the observation tokens once, with mask 0 → … until the env terminates or
truncates, or the token budget runs out (then ``truncated``).

The token ids and the loss mask are written by :class:`agentgym.rollout.writer.
TrajectoryWriter`, as they are for demonstrations and an agent's recorded calls: sampled ids
with mask 1 and the engine's logprobs; prompt, filler and observation ids with mask 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from typing import Any, Callable

from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.context import (CONTINUE, DROPPED, SUMMARY_REQUEST, Blocks, after_summary,
                                      drop_observations, joined, load_strategy)
from agentgym.config import RolloutConfig
from agentgym.rollout.engines.base import Engine
from agentgym.rollout.writer import TrajectoryWriter
from agentgym.supervision import stalls
from agentgym.supervision.daemon_pool import DaemonPool, stuck_calls
from agentgym.supervision.stalls import (Cut, Site, StallsEndRun, code_site, cut_call,
                                  thread_site)
from agentgym.supervision.supervisor import ServiceFailed, raise_if_failed, wait_healthy
from agentgym.supervision.watchdog import DeadlinesConfig
from agentgym.core.types import SUMMARY_SEED_STRIDE, SamplingParams, Trajectory

logger = logging.getLogger(__name__)

#: how long a replay waits for the local services to be healthy again (a restart takes
#: seconds; a supervisor that gives up ends the wait at once)
INFRA_WAIT_S = 120.0
#: how long the close of an episode the run's end cancelled is waited for
CLOSE_WHEN_ENDING_S = 5.0


class _Unmade:
    """The env of an episode whose env's construction stalled: it is written on the row's
    own prompt, as an infrastructure failure."""

    observation_format, stop_strings, tools = "chat", (), None

    def close(self) -> None:
        pass


_UNMADE = _Unmade()


class CallStalled(RuntimeError):
    """An env call ran past ``deadlines.env_step_s``, or a generation past
    ``deadlines.turn_s``: the episode ends as an infrastructure failure."""


async def _wait_for_services() -> None:
    """Wait (at most :data:`INFRA_WAIT_S`) until the supervised services are healthy again
    or one has failed for good, in slices of a second: a thread of the loop's default
    executor (not an env worker) waits, and a cancelled episode (the run ending) lets it
    go within a second instead of holding the loop's shutdown for the whole wait."""
    deadline = time.monotonic() + INFRA_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        if await asyncio.to_thread(wait_healthy, min(1.0, left)):
            return
        try:
            raise_if_failed()
        except ServiceFailed:
            return


async def pool_call(pool: DaemonPool, deadlines: DeadlinesConfig, what: str, episode: str,
                    fn, *args, limit: float | None = None, **kwargs):
    """``fn`` (an env's construction, reset, step or close; a reward) in ``pool``, under
    ``deadlines.env_step_s`` from when it starts running (``limit`` instead: a close
    while the episode is being cancelled, not recorded as a stall). Past it, the call is
    given up on (its processes killed, or its thread left in it and replaced:
    :meth:`DaemonPool.give_up <agentgym.supervision.daemon_pool.DaemonPool.give_up>`), the cut
    recorded by where the call hangs (:mod:`agentgym.supervision.stalls`: the site's file has
    the stacks) and :class:`CallStalled` raised; or the error that ends the run, when
    the site has cut ``deadlines.same_stall_limit`` episodes in a row or more than
    ``deadlines.max_abandoned`` calls are stuck."""
    d = deadlines
    deadline = d.env_step_s if limit is None else limit
    call, submitted = pool.submit(fn, *args, **kwargs), time.monotonic()
    waiting = asyncio.wrap_future(call)
    try:
        # env_step_s counts from the call's start, not its time queued behind calls that
        # are hanging but not yet past theirs; a limit counts from now (a close while the
        # run ends must not wait for a worker)
        while True:
            running = pool.running(call)
            began = running.started if running is not None and limit is None else submitted
            done, _ = await asyncio.wait({waiting}, timeout=max(
                deadline - (time.monotonic() - began), 0.01))
            if done:
                return waiting.result()
            running = pool.running(call)
            if limit is not None or (running is not None and
                                     time.monotonic() - running.started >= deadline):
                break
    except asyncio.CancelledError:  # the episode ended (the run is ending): not waited
        pool.give_up(call)  # for, should the call be stuck
        raise
    if limit is not None:  # a close while the run ends: given up on quietly
        pool.give_up(call)
        raise CallStalled(f"episode {episode}: env.{what} had not returned {deadline:g}s "
                          f"after it was asked for, as the run ends")
    reason = f"episode {episode}: env.{what} made no progress for {deadline:g}s " \
             f"(deadlines.env_step_s)"
    # a call waiting on its process (reward_process=true): the function it runs there
    site = (running.delegate and code_site(running.delegate)) or \
        thread_site(running.thread.ident) or Site(getattr(fn, "__name__", what), "?", 0)
    cut = Cut(site, episode, f"env.{what}", f"deadlines.env_step_s={deadline:g}",
              pool.fate(call))
    path = cut_call(cut, reason, d, lambda: pool.give_up(call), stuck_calls)
    raise CallStalled(reason + (f"; stacks: {path}" if path else ""))


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
                 cfg: RolloutConfig, seed: int = 0, allow_weight_updates: bool = False,
                 deadlines: DeadlinesConfig | None = None) -> None:
        self.engine = engine
        self.chat = ChatTokens(tokenizer)
        self.env_factory = env_factory
        self.cfg = cfg
        self.seed = seed
        #: asynchronous training: a weight update may land between the turns of an
        #: episode; each turn records its version (else such an update is an error)
        self.allow_weight_updates = allow_weight_updates
        #: an env step past ``deadlines.env_step_s`` ends its episode (agentgym.supervision.watchdog)
        self.deadlines = deadlines or DeadlinesConfig()
        self._pool = DaemonPool(cfg.env_workers, thread_name_prefix="env")
        self._sessions = itertools.count()
        cfg.check_context()
        self._user_strategy = load_strategy(cfg.context)

    async def _env_call(self, what: str, episode: str, fn, *args, limit: float | None = None,
                        **kwargs):
        return await pool_call(self._pool, self.deadlines, what, episode, fn, *args,
                               limit=limit, **kwargs)

    async def play(self, row: dict, uid: str = "0", sample_index: int = 0,
                   base_seed: int | None = None) -> list[Trajectory]:
        """Play one episode of ``row``; return its trajectories: one, or several when
        ``rollout.context`` rewrote the history (:mod:`agentgym.rollout.context`).
        ``base_seed`` overrides the manager's ``seed`` for this episode.

        An episode a tool failure of the infrastructure's marked (``metrics
        ["infra_failures"] > 0``, the reason in ``info["infra_error"]``) is, with
        ``rollout.on_infra_error=retry``, played once more with the same seed when the
        local services are healthy again (``metrics["infra_retried"] = 1``); whether a
        still-marked episode is trained on is the trainer's choice (``agentgym.trainers.collection``).
        """
        parts = await self._play(row, uid, sample_index, base_seed)
        if parts[-1].metrics["infra_failures"] and self.cfg.on_infra_error == "retry":
            logger.warning("episode %s/%d hit an infrastructure failure (%s); replaying it "
                           "once the services answer", uid, sample_index,
                           parts[-1].info.get("infra_error", "?"))
            await _wait_for_services()
            parts = await self._play(row, uid, sample_index, base_seed)
            for t in parts:
                t.metrics["infra_retried"] = 1.0
        return parts

    async def play_one(self, row: dict, uid: str = "0", sample_index: int = 0,
                       base_seed: int | None = None) -> Trajectory:
        """:meth:`play` for an episode that stays one trajectory (``rollout.context=keep``)."""
        parts = await self.play(row, uid, sample_index, base_seed)
        if len(parts) != 1:
            raise ValueError(f"episode {uid}/{sample_index} became {len(parts)} trajectories "
                             f"(rollout.context={self.cfg.context}); use play()")
        return parts[0]

    def _tokens_per_turn(self, row: dict) -> int:
        """One action's token budget: the row's env's own in a mixed run, else the run's."""
        own = getattr(self.env_factory, "tokens_per_turn", None)
        return (own(row) if own else None) or self.cfg.max_tokens_per_turn

    async def _play(self, row: dict, uid: str, sample_index: int,
                    base_seed: int | None) -> list[Trajectory]:
        cfg = self.cfg
        seed = trajectory_seed(self.seed if base_seed is None else base_seed, uid, sample_index)
        session = f"{uid}/{sample_index}/{seed}/{next(self._sessions)}"  # one per episode
        m = {"turns": 0, "generate_s": 0.0, "env_s": 0.0, "length_stops": 0}
        env: Any = _UNMADE
        ending = None
        try:
            t0, stalled = time.perf_counter(), None
            try:
                env = await self._env_call("make", session, self.env_factory, *(
                    [row] if getattr(self.env_factory, "takes_row", False) else []))
                t0 = time.perf_counter()
                obs, info = await self._env_call("reset", session, env.reset, seed=seed,
                                                 options={"row": row})
            except CallStalled as e:  # the row's own prompt stands in for the env's
                stalled, obs, info = e, [dict(x) for x in row.get("prompt") or []], {}
            m["env_s"] += time.perf_counter() - t0
            prompt, images = self.chat.prompt(obs, tools=getattr(env, "tools", None))
            if len(prompt) > cfg.max_prompt_tokens:
                raise ValueError(f"prompt of row {uid!r} has {len(prompt)} tokens, more than "
                                 f"rollout.max_prompt_tokens={cfg.max_prompt_tokens}")
            ep = _Episode(self.chat, env.observation_format, row, uid, sample_index)
            traj, w = ep.start(prompt, 0, images, self.engine.policy_version)
            blocks: Blocks = [("prompt", prompt)]  # the context, for rollout.context
            step = turn = 0  # the env's steps; turns count every generation (summaries too)
            try:
                if stalled is not None:  # not played: an infrastructure failure
                    raise stalled
                while True:
                    if cfg.context != "keep" and len(traj.token_ids) > cfg.context_tokens:
                        new = await self._compact(blocks, w, turn, seed, session, m)
                        if new is not None:  # the rewritten context starts a new part
                            if cfg.context == "summarize":  # the summary was a turn: reward 0
                                ep.rewards.append(0.0)
                                turn += 1
                            blocks = new
                            traj, w = ep.start(joined(blocks), turn, traj.images,
                                               self.engine.policy_version)
                    budget = cfg.max_response_tokens - traj.response_length
                    if budget <= 0:
                        traj.truncated, info = True, {**info, "end": "token_budget"}
                        break
                    sampling = SamplingParams.for_turn(
                        cfg, min(self._tokens_per_turn(row), budget), seed, step,
                        stop=env.stop_strings)
                    out = await self._generate(w, sampling, session, turn, m)
                    text, t0 = self.chat.decode(out.ids), time.perf_counter()
                    turn += 1
                    try:
                        obs, reward, terminated, truncated, info = \
                            await self._env_call("step", session, env.step, text)
                    finally:  # a stalled step ends the episode with this turn's reward 0
                        m["env_s"] += time.perf_counter() - t0
                    step += 1
                    ep.rewards.append(reward)
                    if terminated or truncated:
                        traj.terminated, traj.truncated = terminated, truncated
                        break
                    after = w.after_action(out.ids, obs, turn - 1, cfg.max_response_tokens)
                    if after is None:  # no room left for another action
                        traj.truncated, info = True, {**info, "end": "token_budget"}
                        break
                    filler, obs_ids = after
                    blocks += [("generated", list(out.ids)), ("filler", filler),
                               ("observation", obs_ids)]
            except CallStalled as e:  # a reset, step or generation past its deadline
                ep.rewards += [0.0] * (turn - len(ep.rewards))  # its turns: no reward
                traj.truncated = True  # an infrastructure failure: not trained on
                info = {**info, "infra_failures": 1, "infra_error": str(e), "end": "stalled"}
        except BaseException as e:
            ending = e
            raise
        finally:
            closed = await self._close(env, session, ending)
        if closed and info.get("end") != "stalled":  # a stall site's cuts in a row end here
            stalls.ledger().finished()
        return ep.finish(info, m, f"{uid}/{sample_index}/{seed}")

    async def _close(self, env, session: str, ending: BaseException | None) -> bool:
        """Close the episode's env; whether it closed in time. The close of an episode the
        run is ending (cancelled, or its stall ended the run) is not waited for long."""
        quick = isinstance(ending, (asyncio.CancelledError, StallsEndRun))
        try:
            await self._env_call("close", session, env.close,
                                 limit=CLOSE_WHEN_ENDING_S if quick else None)
        except CallStalled as e:
            logger.warning("%s", e)
            return False
        return True

    async def _generate(self, w: TrajectoryWriter, sampling: SamplingParams, session: str,
                        turn: int, m: dict):
        """Sample one turn onto ``w``'s trajectory (its ids, logprobs and policy version)."""
        traj = w.traj
        t0 = time.perf_counter()
        limit = self.deadlines.turn_s
        try:  # a request past its deadline is cancelled (the engine drops its row)
            out = await asyncio.wait_for(self.engine.generate(
                traj.token_ids, sampling, images=traj.images, session_id=session), limit)
        except TimeoutError:
            reason = f"episode {session}: a generation made no progress for {limit:g}s " \
                     f"(deadlines.turn_s)"
            ledger = stalls.ledger()
            ended = ledger.cut(Cut(stalls.ENGINE_SITE, session, "generate",
                                   f"deadlines.turn_s={limit:g}", "cancelled"),
                               self.deadlines.same_stall_limit, reason)
            if ended is not None:
                raise ended from None
            path = ledger.path(stalls.ENGINE_SITE)
            raise CallStalled(reason + (f"; stacks: {path}" if path else "")) from None
        m["generate_s"] += time.perf_counter() - t0
        version = out.policy_version if out.policy_version is not None \
            else self.engine.policy_version
        if version != traj.policy_version and not self.allow_weight_updates:
            raise RuntimeError("policy weights changed inside a trajectory; "
                               "pause() the engine between rollouts")
        traj.turn_versions.append(version)
        traj.token_versions += out.token_versions or [version] * len(out.ids)
        w.sampled(out.ids, out.logprobs, turn)
        m["turns"] += 1
        m["length_stops"] += out.finish_reason == "length"
        return out

    async def _compact(self, blocks: Blocks, w: TrajectoryWriter, turn: int, seed: int,
                       session: str, m: dict) -> Blocks | None:
        """The context under ``rollout.context`` (:mod:`agentgym.rollout.context`), or None
        when it stays as it is. ``summarize`` samples the summary onto ``w``'s trajectory (a
        turn)."""
        strategy, traj, fmt = self.cfg.context, w.traj, w.fmt
        if strategy == "drop_observations":
            new = drop_observations(blocks, self.chat.observation_ids(
                [{"role": "user", "content": DROPPED}], fmt))
        elif strategy == "summarize":
            request = self.chat.observation_ids([{"role": "user", "content": SUMMARY_REQUEST}],
                                                fmt)
            if traj.response_length + len(request) >= self.cfg.max_response_tokens:
                return None
            w.observation(request, max(turn - 1, 0))
            room = self.cfg.max_response_tokens - traj.response_length - len(request)
            sampling = SamplingParams.for_turn(self.cfg, min(self.cfg.max_tokens_per_turn, room),
                                               seed, turn + 1, stride=SUMMARY_SEED_STRIDE)
            out = await self._generate(w, sampling, session, turn, m)
            filler, cont = self.chat.after_action_ids(
                out.ids, [{"role": "user", "content": CONTINUE}], fmt)
            return after_summary(blocks, out.ids, filler, cont)
        else:
            new = self._user_strategy(blocks, self.chat.tok)
        if new is None or joined(new) == joined(blocks):
            return None
        return [(kind, list(ids)) for kind, ids in new]

    async def run(self, rows: list[dict], n: int | None = None,
                  on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Roll out ``n`` samples of every row concurrently (at most ``max_concurrency``
        episodes in flight); results keep the order ``(row, sample)`` (an episode's
        trajectories in order, when context management split it)."""
        n = n or self.cfg.n
        gate = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(i: int, row: dict, k: int) -> list[Trajectory]:
            async with gate:
                parts = await self.play(row, row_uid(row, i), k)
            if on_done is not None:
                on_done(parts[-1])  # once per episode
            return parts

        tasks = [one(i, row, k) for i, row in enumerate(rows) for k in range(n)]
        return [t for parts in await asyncio.gather(*tasks) for t in parts]

    def close(self) -> None:
        # env calls still queued are not started (a run that ends mid-rollout, SIGTERM);
        # the running ones finish, but for those no episode waits for any more (stuck past
        # deadlines.env_step_s, or of an episode the run's end cancelled)
        if stuck := self._pool.stuck:
            logger.warning("%d env call(s) no episode waits for are left running (stuck past "
                           "deadlines.env_step_s: their stacks are in the run's stalls/ "
                           "folder; or cut short by the run's end)", stuck)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (
        isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v))


def episode_metric_keys(trajs: list[Trajectory]) -> list[str]:
    """The info keys the trajectories' envs report as episode metrics, in first-seen order."""
    return list(dict.fromkeys(k for t in trajs for k in t.info.get("episode_metrics", ())))


def summarize(trajs: list[Trajectory]) -> dict[str, float]:
    """Mean metrics over episodes (reward, em, f1, turns, lengths, tool counters): an
    episode that became several trajectories (``info["parts"]``) counts once, each of its
    trajectories weighing 1 / its parts (they share the episode's reward and info)."""
    if not trajs:
        return {}
    w = [1.0 / t.info.get("parts", 1) for t in trajs]
    total = sum(w)
    mean = lambda f: sum(x * f(t) for x, t in zip(w, trajs)) / total  # noqa: E731
    out: dict[str, float] = {"count": float(len(trajs))}
    out["reward"] = mean(lambda t: t.reward)
    for key in ("em", "f1"):
        out[key] = mean(lambda t: float(t.info.get(key, 0.0)))
    for key in episode_metric_keys(trajs):  # what the envs declare (AgentEnv.episode_metrics)
        out[key] = mean(lambda t: float(t.info.get(key, 0)))
    out["answered"] = mean(lambda t: float(t.terminated))
    # an env that defines its own (env=swe: a command, then a diff that applies) reports it
    # in info, as the evaluation's episodes read it; else: ended with no malformed action
    out["format_valid"] = mean(lambda t: float(t.info["format_valid"]) if "format_valid" in
                               t.info else float(t.terminated
                                                 and t.metrics["malformed_actions"] == 0))
    out["truncated"] = mean(lambda t: float(t.truncated))
    for key in trajs[0].metrics:
        out[key] = mean(lambda t: t.metrics[key])
    return out


class _Episode:
    """One episode's trajectories: the first, and one more each time ``rollout.context``
    rewrites the context (:mod:`agentgym.rollout.context`); ``ranges`` holds each part's
    first and last turn, ``rewards`` every turn's reward."""

    def __init__(self, chat: ChatTokens, fmt: str, row: dict, uid: str, sample_index: int):
        self.chat, self.fmt, self.row = chat, fmt, row
        self.uid, self.sample_index = uid, sample_index
        self.parts: list[Trajectory] = []
        self.ranges: list[list[int]] = []
        self.rewards: list[float] = []

    def start(self, prompt: list[int], turn: int, images: Any, policy_version: int
              ) -> tuple[Trajectory, TrajectoryWriter]:
        """A new part whose prompt is ``prompt`` (the whole context), from ``turn`` on."""
        if self.ranges:
            self.ranges[-1][1] = turn - 1
        traj = Trajectory(uid=self.uid, sample_index=self.sample_index,
                          data_source=str(self.row.get("data_source", "")))
        traj.images, traj.policy_version = images, policy_version
        w = TrajectoryWriter(traj, self.chat, self.fmt)
        w.prompt(prompt, turn)
        self.parts.append(traj)
        self.ranges.append([turn, -1])
        return traj, w

    def finish(self, info: dict, m: dict, episode: str) -> list[Trajectory]:
        """The trajectories completed: each part's step rewards (its turns', indexed by
        turn, and the later parts' on its last turn), the episode's reward, info, version
        and metrics."""
        parts, ranges, turn_rewards = self.parts, self.ranges, self.rewards
        ranges[-1][1] = len(turn_rewards) - 1
        traj = parts[-1]
        info = {k: v for k, v in info.items() if _jsonable(v)}
        info.setdefault("env", str(self.row.get("env", "")))  # per-env metrics of mixed runs
        counters = {
            **{k: float(v) for k, v in m.items()},
            "tool_calls": float(info.get("tool_calls", 0)),
            "tool_failures": float(info.get("tool_failures", 0)),
            "malformed_actions": float(info.get("malformed_actions", 0)),
            "infra_failures": float(info.get("infra_failures", 0)),
            "infra_retried": 0.0}
        episode_return = float(sum(turn_rewards))
        for j, (part, (first, last)) in enumerate(zip(parts, ranges)):
            # this part's turns' rewards (indexed by turn), the later parts' on its last turn
            part.step_rewards = [0.0] * first + turn_rewards[first:last + 1]
            if part.step_rewards and j < len(parts) - 1:
                part.step_rewards[-1] += float(sum(turn_rewards[last + 1:]))
                part.terminated, part.truncated = traj.terminated, False
            if part.turn_versions:
                part.policy_version = min(part.turn_versions)
            part.reward = episode_return
            part.info = dict(info)
            if len(parts) > 1:
                part.info.update(episode=episode, part=j,
                                 parts=len(parts))
            part.metrics = {
                **counters,
                "prompt_length": float(part.prompt_length),
                "response_length": float(part.response_length),
                "generated_tokens": float(part.num_sampled),
                "observation_tokens": float(sum(len(s) for s in part.segments
                                                if s.kind in ("observation", "filler"))),
            }
            part.check()
        return parts


def last_parts(trajs: list[Trajectory]) -> list[Trajectory]:
    """One trajectory per episode, its last (the one holding the final answer): what an
    evaluation scores when an episode became several (``rollout.context``, an agent that
    rewrote its history)."""
    return [t for t in trajs if t.info.get("part", 0) == t.info.get("parts", 1) - 1]
