"""Training an agent written against the OpenAI SDK: ``env=agent agent=pkg.module:run``.

``run(row, client)`` (a function or a coroutine function) is ordinary agent code: it gets a
dataset row and an OpenAI client (``openai.OpenAI`` / ``openai.AsyncOpenAI``; a function
whose second parameter is named ``base_url`` gets the URL instead) and returns the
episode's reward (or None, and ``reward=`` scores it). Every episode gets its own endpoint
on the rollout engine, ``http://127.0.0.1:PORT/episodes/EPISODE/v1`` (its API key is the
episode's id too, so an agent with a fixed base URL is still told apart), serving OpenAI's
API (:mod:`agentgym.serving.openai_api`) and recording each call's prompt ids, sampled ids
and logprobs exactly as the engine saw them: nothing is re-tokenised.

The token stream: a chat call whose messages extend the previous call's messages plus the
reply that call returned is prompted with the previous call's ids, its sampled ids, the
template's closing of the assistant turn and the new messages rendered alone (the rule the
envs' rollouts use, :meth:`agentgym.rollout.chat.ChatTokens.after_action_ids`), so the model
conditions on exactly the tokens it sampled. Calls whose prompt extends the previous
call's prompt plus completion token for token form one trajectory, the completions
masked in; an agent that rewrites its history (a summary, a dropped turn) starts a new
trajectory, and the episode yields several, sharing its reward (their advantages count the
episode once: :func:`agentgym.trainers.algos._group_stats`). The drift between the recorded prompt
and the chat template's rendering of the same messages is measured per call
(``agent/drift_calls``, ``agent/drift_tokens``).

Sampling is the run's (``rollout.temperature``, ``top_p``, ``top_k``; a per-call seed
derived from the episode's), so the recorded logprobs are the ones the trainer
recomputes; a call's ``max_tokens`` is capped at ``rollout.max_tokens_per_turn``; an
episode makes at most ``rollout.max_turns`` calls (the next is a 400 saying so). An
exception in the agent ends its episode as failed: logged, counted (``agent/failed``), not
trained on.

An agent that goes ``deadlines.env_step_s`` without a call to its endpoint (its own code or
a tool hangs), or whose call runs past ``deadlines.turn_s`` (the engine stalls), is cut as
an env call is (:func:`agentgym.rollout.manager.pool_call`): not trained on, counted
(``agent/stalled``), recorded by where it hangs (:mod:`agentgym.supervision.stalls`: one stack
file per site, and the same site hanging ``deadlines.same_stall_limit`` episodes in a row
ends the run); a function agent's thread is replaced (or its processes killed), a
coroutine agent's task cancelled. A reward it leaves to ``reward=`` runs under
``deadlines.env_step_s`` too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

from agentgym.supervision import stalls
from agentgym.supervision.daemon_pool import DaemonPool, stuck_calls
from agentgym.supervision.stalls import (Cut, Site, StallsEndRun, cut_call, frames_site,
                                  thread_site)
from agentgym.core.types import SamplingParams, Trajectory
from agentgym.rollout.manager import CallStalled, pool_call, row_uid, trajectory_seed
from agentgym.rollout.writer import TrajectoryWriter
from agentgym.serving.openai_api import OpenAIFrontend, openai_routes
from agentgym.serving.openai_chat import _messages, chat_choice
from agentgym.serving.openai_common import Call, OpenAIError
from agentgym import envs
from agentgym.core.registry import env_names
from agentgym.envs.plugins import load_reward, load_spec
from agentgym.rollout.chat import ChatTokens
from agentgym.supervision.server_process import free_port
from agentgym.supervision.process_call import call_in_process
from agentgym.tools.errors import MissingExtra

logger = logging.getLogger(__name__)


@dataclass
class Turn:
    """One recorded call of an episode."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    drift_tokens: int = -1  # prompt tokens after the first that re-rendering changes (-1: n/a)
    tool_calls: int = 0
    finish: str = "stop"


@dataclass
class _Last:
    messages: list[dict] | None  # the call's messages and its reply, normalized (chat)
    tools: list[dict] | None
    ids: list[int]  # prompt + completion
    completion: list[int]


@dataclass
class Episode:
    """What an episode's endpoint recorded, and how the agent ended."""

    eid: str
    turns: list[Turn] = field(default_factory=list)
    final_text: str = ""
    error: str = ""


class EpisodeFrontend(OpenAIFrontend):
    """One episode's OpenAI endpoint (see the module docstring)."""

    def __init__(self, engine, tokenizer, chat_tokens, rollout, seed: int, eid: str,
                 greedy: bool = False) -> None:
        super().__init__(engine, tokenizer, "agentgym-policy",
                         default_max_tokens=rollout.max_tokens_per_turn,
                         on_call=self._remember, chat_tokens=chat_tokens)
        self.rollout, self.seed, self.greedy = rollout, seed, greedy
        self.episode = Episode(eid)
        self._last: _Last | None = None
        self._full: list[int] | None = None  # this call's prompt as the template renders it
        #: the agent's progress (a call begun or answered: time.monotonic()), calls running
        self.progress_at, self.in_flight = time.monotonic(), 0

    async def chat(self, body: dict):
        return await self._timed(super().chat(body))

    async def completions(self, body: dict):
        return await self._timed(super().completions(body))

    async def _timed(self, answer):
        self.in_flight += 1
        self.progress_at = time.monotonic()
        try:
            return await answer
        finally:
            self.in_flight -= 1
            self.progress_at = time.monotonic()

    def model(self, name: str) -> dict:  # any name: the agent's model is the policy
        return {"id": name, "object": "model", "created": self.created, "owned_by": "agentgym"}

    def chat_prompt(self, messages, tools, forced) -> list[int]:
        full = super().chat_prompt(messages, tools, forced)
        last, self._full = self._last, None
        if last is None or last.messages is None or tools != last.tools:
            return full
        k = len(last.messages)
        if len(messages) <= k or messages[:k] != last.messages or \
                messages[k]["role"] == "assistant":
            return full  # the history was rewritten: the template's rendering, anew
        filler, new = self.chat_tokens.after_action_ids(last.completion, messages[k:], "chat")
        self._full = full
        return last.ids + filler + new + (self.chat_tokens.encode(forced) if forced else [])

    def samplings(self, plan) -> list[SamplingParams]:
        if plan.n != 1:
            raise OpenAIError(f"n={plan.n}: an episode's calls sample one choice; the run "
                              f"plays rollout.n episodes of each row instead", param="n")
        r, turn = self.rollout, len(self.episode.turns)
        if turn >= r.max_turns:
            raise OpenAIError(f"this episode has made {turn} calls, its budget "
                              f"(rollout.max_turns={r.max_turns})", code="episode_budget")
        return [SamplingParams.for_turn(
            r, min(plan.sampling.max_new_tokens, r.max_tokens_per_turn), self.seed, turn,
            stop=plan.sampling.stop, greedy=self.greedy, top_logprobs=plan.sampling.top_logprobs)]

    def _remember(self, call: Call) -> None:
        out = call.outputs[0]
        reply, calls = None, 0
        if call.kind == "chat":
            message = chat_choice(self, call.plan, 0, out)["message"]
            calls = len(message.get("tool_calls") or [])
            reply = _messages(self, [message])[0]
            self.episode.final_text = message.get("content") or ""
        else:
            self.episode.final_text = self.text(out, call.plan.sampling.stop)
        drift = -1
        if self._full is not None:
            same = next((i for i, (a, b) in enumerate(zip(call.prompt_ids, self._full))
                         if a != b), min(len(call.prompt_ids), len(self._full)))
            drift = 0 if call.prompt_ids == self._full else len(self._full) - same
        version = out.policy_version if out.policy_version is not None \
            else self.engine.policy_version
        self.episode.turns.append(Turn(list(call.prompt_ids), list(out.ids),
                                       list(out.logprobs), version, drift, calls,
                                       out.finish_reason))
        self._last = _Last(None if reply is None else [*call.messages, reply], call.tools,
                           list(call.prompt_ids) + list(out.ids), list(out.ids))


def trajectories(episode: Episode, uid: str, k: int, reward: float,
                 data_source: str = "", env: str = "") -> list[Trajectory]:
    """The episode's calls as trajectories, written by the writer rollouts use
    (:class:`~agentgym.rollout.writer.TrajectoryWriter`): a call whose prompt extends the
    current trajectory token for token continues it (the new prompt tokens masked out, the
    completion in); any other starts a new one. Each gets the episode's reward."""
    out: list[Trajectory] = []
    w: TrajectoryWriter | None = None
    for i, t in enumerate(episode.turns):
        if w is None or not w.extend(t.prompt_ids, i):
            w = TrajectoryWriter(Trajectory(uid=uid, sample_index=k, data_source=data_source))
            w.prompt(t.prompt_ids, i)
            w.traj.step_rewards = [0.0] * i  # step rewards are indexed by the episode's turn
            out.append(w.traj)
        w.sampled(t.completion_ids, t.logprobs, i)
        cur = w.traj
        cur.turn_versions.append(t.version)
        cur.step_rewards.append(0.0)
        cur.metrics["tool_calls"] = cur.metrics.get("tool_calls", 0.0) + t.tool_calls
        cur.metrics["length_stops"] = cur.metrics.get("length_stops", 0.0) + \
            (t.finish == "length")
    for j, traj in enumerate(out):
        traj.step_rewards[-1] = reward
        traj.reward, traj.terminated = reward, True
        traj.policy_version = min(traj.turn_versions)
        traj.info = {"env": env, "episode": episode.eid, "part": j, "parts": len(out),
                     "em": reward, "answer": episode.final_text[:500]}
        observed = sum(len(s) for s in traj.segments if s.kind == "observation")
        traj.metrics = {"turns": float(len(traj.turn_versions)), "generate_s": 0.0,
                        "env_s": 0.0, "length_stops": traj.metrics["length_stops"],
                        "tool_calls": traj.metrics["tool_calls"], "tool_failures": 0.0,
                        "malformed_actions": 0.0, "infra_failures": 0.0,
                        "infra_retried": 0.0, "prompt_length": float(traj.prompt_length),
                        "response_length": float(traj.response_length),
                        "generated_tokens": float(traj.num_sampled),
                        "observation_tokens": float(observed)}
        traj.check()
    return out


def load_agent(spec: str):
    """The agent function ``spec`` (``package.module:function``) names; the working
    directory is searched too (as ``uvicorn app:app`` does), so an agent beside the data
    needs no installing."""
    import os
    import sys

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if not spec:
        raise ValueError("env=agent needs agent=package.module:function, a function "
                         "run(row, client) (or async) that returns the episode's reward")
    fn = load_spec(spec, "agent")
    if not callable(fn):
        raise ValueError(f"agent={spec!r} is {type(fn).__name__}, not a function")
    return fn


def program_manager(manager, engine, tokenizer, cfg) -> "AgentManager":
    """For ``env=agent`` (and an env that names its own :func:`env_program`): the
    runtime's env manager closed, an :class:`AgentManager` on the same engine in its place
    (``rollout`` and ``eval`` use it as ``train`` does)."""
    manager.close()
    return AgentManager(engine, tokenizer, cfg, cfg.trainer.seed,
                        greedy=cfg.rollout.temperature == 0)


def env_program(cfg):
    """The player of an env whose manifest names one (:attr:`EnvManifest.program
    <agentgym.envs.manifest.EnvManifest.program>`: ``env=verifiers``), built with the
    run's config; None for ``env=agent`` (``agent=`` plays)."""
    specs = {envs.env_manifest(e).program for e in env_names(cfg.env)} - {""}
    if len(specs) > 1:
        raise ValueError(f"env={cfg.env!r} mixes envs played by different programs "
                         f"({', '.join(sorted(specs))}); train them in separate runs")
    return load_spec(specs.pop(), "program")(cfg) if specs else None


class AgentManager:
    """Plays ``agent=`` over rows, as :class:`~agentgym.rollout.manager.GenerationManager`
    plays an env: ``run(rows, n)`` returns the trajectories (an episode may yield
    several), and :attr:`stats` the step's counts (:meth:`take_stats`)."""

    def __init__(self, engine, tokenizer, cfg, seed: int = 0, greedy: bool = False,
                 program=None) -> None:
        self.engine, self.tok, self.cfg, self.seed = engine, tokenizer, cfg, seed
        self.greedy = greedy
        if program is None and not cfg.agent:
            program = env_program(cfg)
        self.program = program  # an env's own player (EnvManifest.program), closed with us
        self.fn = program.play if program is not None else load_agent(cfg.agent)
        self.reward_fn = None
        if cfg.reward:
            import functools

            self.reward_fn = load_reward(cfg.reward)
            if cfg.reward_process:
                self.reward_fn = functools.partial(call_in_process, self.reward_fn)
        self.chat_tokens = ChatTokens(tokenizer, image_processor=None)
        self.episodes: dict[str, EpisodeFrontend] = {}
        # daemon threads: a stuck agent is left behind (its place taken), never joined
        self._pool = DaemonPool(cfg.rollout.max_concurrency, thread_name_prefix="agent")
        self.stats = _zero_stats()
        self._server, self._thread, self.url = _serve(self._route)

    def _route(self, request) -> EpisodeFrontend:
        eid = request.path_params.get("eid") or \
            request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if eid not in self.episodes:
            raise OpenAIError(f"no running episode {eid!r}: each episode has its own base URL "
                              f"(or API key); this one has ended or never began", 404,
                              code="episode_not_found")
        return self.episodes[eid]

    async def play(self, row: dict, uid: str, k: int,
                   base_seed: int | None = None) -> list[Trajectory]:
        """One episode of ``row``: its trajectories (none when the agent failed)."""
        seed = trajectory_seed(self.seed if base_seed is None else base_seed, uid, k)
        eid = f"{uid}-{k}-{uuid.uuid4().hex[:8]}"
        front = EpisodeFrontend(self.engine, self.tok, self.chat_tokens, self.cfg.rollout,
                                seed, eid, self.greedy)
        self.episodes[eid] = front
        t0 = time.perf_counter()
        try:
            reward = await self._play(row, eid)
        except StallsEndRun:  # the same site keeps hanging: the run ends
            raise
        except (AgentStalled, CallStalled) as e:  # cut: written to the run's stalls/
            logger.warning("agent episode %s cut: %s", eid, e)
            self.stats["stalled"] += 1
            return []
        except Exception as e:  # the agent's own failure: logged, counted, not trained on
            logger.warning("agent episode %s failed: %s: %s", eid, type(e).__name__, e)
            self.stats["failed"] += 1
            stalls.ledger().finished()
            return []
        finally:
            self.episodes.pop(eid, None)
        stalls.ledger().finished()
        trajs = trajectories(front.episode, uid, k, reward, str(row.get("data_source", "")),
                             self.cfg.env)
        for t in trajs:
            t.metrics["env_s"] = time.perf_counter() - t0
        self._count(front.episode, trajs)
        return trajs

    async def _play(self, row: dict, eid: str) -> float:
        url = f"{self.url}/episodes/{eid}/v1"
        params = list(inspect.signature(self.fn).parameters)
        wants_url = len(params) > 1 and params[1] == "base_url"
        front = self.episodes[eid]
        if inspect.iscoroutinefunction(self.fn):
            client = url if wants_url else _client(url, eid, asynchronous=True)
            result = await self._watched(front, asyncio.ensure_future(self.fn(row, client)))
        else:
            client = url if wants_url else _client(url, eid, asynchronous=False)
            result = await self._watched(front, self._pool.submit(self.fn, row, client))
        episode = front.episode
        if not episode.turns:
            raise RuntimeError("the agent made no call to its endpoint")
        if result is None:
            if self.reward_fn is None:
                raise ValueError("the agent returned None and no reward= was given")
            result = await pool_call(self._pool, self.cfg.deadlines, "reward", eid,
                                     self.reward_fn, row.get("data_source", ""),
                                     episode.final_text,
                                     row.get("reward_model", {}).get("ground_truth"),
                                     row.get("extra_info"))
        reward = float(result)
        if not math.isfinite(reward):
            raise ValueError(f"the agent's reward {result!r} is not a finite number")
        return reward

    async def _watched(self, front: EpisodeFrontend, work) -> Any:
        """The agent's result, ``work`` (its task, or its call in the pool) awaited while
        it makes progress: cut (:class:`AgentStalled`) after ``deadlines.env_step_s``
        without a call to its endpoint, or a call of its past ``deadlines.turn_s``."""
        d, eid = self.cfg.deadlines, front.episode.eid
        waiting = work if isinstance(work, asyncio.Future) else asyncio.wrap_future(work)
        while True:
            name, limit = ("turn_s", d.turn_s) if front.in_flight else ("env_step_s",
                                                                         d.env_step_s)
            left = limit - (time.monotonic() - front.progress_at)
            if left <= 0:
                break
            done, _ = await asyncio.wait({waiting}, timeout=min(left, 1.0))
            if done:
                return waiting.result()
        reason = f"episode {eid}: " + ("a call of the agent made no progress" if
                                       front.in_flight else "the agent made no call to its "
                                       "endpoint") + f" for {limit:g}s (deadlines.{name})"
        task = work if isinstance(work, asyncio.Task) else None
        if front.in_flight:
            site, outcome = stalls.ENGINE_SITE, "cancelled"
        elif task is not None:
            frames = task.get_stack()
            site, outcome = frames_site(frames), "cancelled"
            reason += "\n# the agent's task:\n" + "".join(
                "# " + line for line in traceback.StackSummary.extract(
                    (f, f.f_lineno) for f in frames).format())
        else:
            running = self._pool.running(work)
            site = thread_site(running.thread.ident) if running else None
            outcome = self._pool.fate(work)
        site = site or Site(getattr(self.fn, "__name__", "agent"), "?", 0)
        cut = Cut(site, eid, "agent", f"deadlines.{name}={limit:g}", outcome)
        path = cut_call(cut, reason, d, task.cancel if task is not None else
                        lambda: self._pool.give_up(work), stuck_calls)
        raise AgentStalled(reason.splitlines()[0] + (f"; stacks: {path}" if path else ""))

    def _count(self, episode: Episode, trajs: list[Trajectory]) -> None:
        s = self.stats
        s["episodes"] += 1
        s["trajectories"] += len(trajs)
        measured = [t.drift_tokens for t in episode.turns if t.drift_tokens >= 0]
        s["extended_calls"] += len(measured)
        s["drifted_calls"] += sum(d > 0 for d in measured)
        s["drift_tokens"] += sum(measured)

    def take_stats(self) -> dict[str, float]:
        """``agent/*`` metrics since the last call: failed and stalled (cut) episodes,
        trajectories per episode, and the share of extending calls whose re-rendered prompt differs."""
        s, self.stats = self.stats, _zero_stats()
        calls = max(s["extended_calls"], 1)
        return {"agent/failed": float(s["failed"]), "agent/stalled": float(s["stalled"]),
                "agent/trajectories_per_episode": s["trajectories"] / max(s["episodes"], 1),
                "agent/drift_calls": s["drifted_calls"] / calls,
                "agent/drift_tokens": s["drift_tokens"] / calls}


    async def run(self, rows: list[dict], n: int | None = None, on_done=None) -> list:
        n = n or self.cfg.rollout.n
        gate = asyncio.Semaphore(self.cfg.rollout.max_concurrency)

        async def one(i: int, row: dict, k: int) -> list:
            async with gate:
                trajs = await self.play(row, row_uid(row, i), k)
            if on_done is not None:
                on_done(trajs)
            return trajs
        groups = await asyncio.gather(*(one(i, row, k) for i, row in enumerate(rows)
                                        for k in range(n)))
        return [t for g in groups for t in g]

    def close(self) -> None:
        if self.program is not None:
            self.program.close()
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=True)


class AgentStalled(RuntimeError):
    """An agent's program made no progress past its deadline: its episode is cut."""


def _zero_stats() -> dict[str, int]:
    return {"failed": 0, "stalled": 0, "episodes": 0, "trajectories": 0, "extended_calls": 0,
            "drifted_calls": 0, "drift_tokens": 0}


def _client(url: str, eid: str, asynchronous: bool):
    try:
        import openai
    except ImportError as e:
        raise MissingExtra("env=agent hands the agent an OpenAI client: pip install openai "
                           "(or name run's second parameter base_url)") from e
    make = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return make(base_url=url, api_key=eid, max_retries=0, timeout=600.0)


def _serve(route) -> tuple[Any, threading.Thread, str]:
    """The episodes' endpoints on loopback (uvicorn in a thread): ``/episodes/{eid}/v1/…``
    and ``/v1/…`` with the episode's id as the API key."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI(title="agentgym agent endpoints")
    openai_routes(app, route, prefix="/episodes/{eid}")
    openai_routes(app, route)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="agent-endpoints")
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the agents' endpoint server did not start")
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"
