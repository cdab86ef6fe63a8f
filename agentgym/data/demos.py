"""Supervised data for the cold start: record formats, tokenization, replay, filtering.

``agentgym sft data=FILE.jsonl`` reads three kinds of JSONL record:

* **demonstration** (``agentgym demos`` writes them): an env episode as text::

      {"type": "demonstration", "env": "search", "uid": "...", "row": {verl row},
       "prompt": [messages env.reset returned], "actions": ["<think>…</think>\\n<search> q </search>", …],
       "observations": [[messages env.step returned after action 0], …], "reward": 1.0}

  ``observations`` has one entry per action but the last (the last action ends the
  episode). An optional ``"learn": [true, false, …]``, one per action (all true when
  absent), keeps an action in the episode but out of the loss: a wrong step played so
  that the recovery after it is what is learned. Text, not ids, so one file serves any model: SFT tokenizes it with the
  policy's tokenizer, written by the writer rollouts use
  (:class:`agentgym.rollout.writer.TrajectoryWriter`), so the token stream and loss mask are
  those of the same episode played by the policy.
* **trajectory** (``agentgym rollout`` / ``agentgym filter`` write them): token ids,
  ``loss_mask`` and segments, used as they are (they must come from this tokenizer).
* **conversation**: ``{"messages": [{role, content}, …]}`` as in TRL; every assistant
  message is learned, each ended by EOS, other messages are chat-template observations.

The loss mask comes from :class:`agentgym.core.types.Trajectory` in every case: 1 on action
tokens (what the policy writes), 0 on the prompt, observations and template filler.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from agentgym.core.types import Trajectory
from agentgym.rollout.chat import ChatTokens
from agentgym.rollout.writer import TrajectoryWriter

logger = logging.getLogger(__name__)

RECORD_KINDS = ("demonstration", "trajectory", "conversation")


def record_kind(record: dict) -> str:
    """Which of :data:`RECORD_KINDS` a JSONL record is; ValueError naming its keys if none."""
    if "actions" in record:
        return "demonstration"
    if "token_ids" in record and "loss_mask" in record:
        return "trajectory"
    if "messages" in record:
        return "conversation"
    raise ValueError(f"record with keys {sorted(record)[:8]} is none of {', '.join(RECORD_KINDS)}: "
                     f"a demonstration has 'actions', a trajectory 'token_ids' and "
                     f"'loss_mask', a conversation 'messages'")


def env_protocol(env: str) -> tuple[str, tuple[str, ...]]:
    """``(observation_format, stop_strings)`` of a registered env (no instance built)."""
    from agentgym.envs.registration import ENVS, resolve_env_id  # lazy: imports the envs
    cls = ENVS.get(resolve_env_id(env))
    return cls.observation_format, tuple(cls.stop_strings)


def demo_to_trajectory(demo: dict, chat: ChatTokens, fmt: str,
                       stop_strings: tuple[str, ...]) -> Trajectory:
    """Tokenize a demonstration as the generation manager writes a rollout (the same
    :class:`~agentgym.rollout.writer.TrajectoryWriter`)."""
    actions, observations = demo["actions"], demo.get("observations", [])
    if not actions or not all(isinstance(a, str) for a in actions):
        raise ValueError(f"demonstration {demo.get('uid')!r}: 'actions' must be a non-empty "
                         f"list of strings")
    if len(observations) != len(actions) - 1:
        raise ValueError(f"demonstration {demo.get('uid')!r}: {len(actions)} actions need "
                         f"{len(actions) - 1} observations (none after the last), got "
                         f"{len(observations)}")
    learn = demo.get("learn", [True] * len(actions))
    if len(learn) != len(actions) or not all(isinstance(x, bool) for x in learn) \
            or not any(learn):
        raise ValueError(f"demonstration {demo.get('uid')!r}: 'learn' must be one true or "
                         f"false per action ({len(actions)}), at least one true; got {learn!r}")
    traj = Trajectory(uid=str(demo.get("uid", "")), data_source=str(demo.get("env", "")),
                      reward=float(demo.get("reward", 0.0)), terminated=True)
    w = TrajectoryWriter(traj, chat, fmt)
    w.prompt(chat.prompt_ids(demo["prompt"]), turn=0)
    for turn, action in enumerate(actions):
        ids = w.written(action, turn, stop_strings, learn=learn[turn])
        if turn < len(observations):
            w.after_action(ids, observations[turn], turn)
    traj.check()
    return traj


def conversation_to_demo(record: dict) -> dict:
    """A chat conversation as a demonstration: messages before the first assistant
    message are the prompt; each assistant message is an action; what follows it (up to
    the next assistant message) is its observation."""
    msgs = record["messages"]
    first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a conversation needs a prompt message before its first assistant "
                         "message, and at least one assistant message")
    actions, observations, pending = [], [], []
    for m in msgs[first:]:
        if m.get("role") == "assistant":
            if actions:
                observations.append(pending)
            actions.append(m["content"])
            pending = []
        else:
            pending.append({"role": m["role"], "content": m["content"]})
    return {"prompt": msgs[:first], "actions": actions, "observations": observations,
            "uid": record.get("uid", ""), "reward": record.get("reward", 0.0)}


def record_to_trajectory(record: dict, chat: ChatTokens, env: str) -> Trajectory:
    """Any :data:`RECORD_KINDS` record → a checked trajectory for this tokenizer."""
    kind = record_kind(record)
    if kind == "trajectory":
        traj = Trajectory.from_dict(record)
        traj.logprobs = [0.0] * len(traj.token_ids)  # SFT does not use rollout logprobs
        vocab = len(chat.tok)
        if traj.token_ids and max(traj.token_ids) >= vocab:
            raise ValueError(f"trajectory {traj.uid!r} has token id {max(traj.token_ids)} "
                             f">= this tokenizer's {vocab} tokens: it was made with another "
                             f"model's tokenizer; re-run `agentgym rollout` with this model")
        traj.check()
        return traj
    if kind == "conversation":
        return demo_to_trajectory(conversation_to_demo(record), chat, "chat", ())
    fmt, stops = env_protocol(record.get("env", env))
    return demo_to_trajectory(record, chat, fmt, stops)


def budget_violation(traj: Trajectory, rollout) -> str | None:
    """Why ``traj`` could not have come out of a rollout under ``rollout``'s budgets
    (prompt, response, per-turn and turn limits), or None if it fits."""
    if traj.prompt_length > rollout.max_prompt_tokens:
        return f"prompt {traj.prompt_length} > rollout.max_prompt_tokens"
    if traj.response_length > rollout.max_response_tokens:
        return f"response {traj.response_length} > rollout.max_response_tokens"
    turns = [s for s in traj.segments if s.kind in ("generated", "played")]
    if len(turns) > rollout.max_turns:
        return f"{len(turns)} actions > rollout.max_turns"
    longest = max((len(s) for s in turns), default=0)
    if longest > rollout.max_tokens_per_turn:
        return f"an action of {longest} tokens > rollout.max_tokens_per_turn"
    return None


def within_budgets(demos: Iterable[dict], chat: ChatTokens, env: str, rollout,
                   limit: int | None = None) -> tuple[list[dict], int, str | None]:
    """The demonstrations a rollout under ``rollout``'s budgets could have produced, in the
    tokens of ``chat``'s tokenizer (:func:`budget_violation`), in order: ``agentgym demos``
    and the cold start keep only these. With ``limit``, the first ``limit`` that fit (those
    after them are not looked at).

    Returns:
        ``(kept, how many were over the budgets, why the first of those was)``.
    """
    kept: list[dict] = []
    over, why = 0, None
    for demo in demos:
        if limit is not None and len(kept) >= limit:
            break
        violation = budget_violation(record_to_trajectory(demo, chat, env), rollout)
        if violation is None:
            kept.append(demo)
        else:
            over += 1
            why = why or violation
    return kept, over, why


def replay_demo(demo: dict, env, seed: int = 0) -> dict[str, Any]:
    """Play a demonstration's actions through ``env``; return what the env said.

    Returns ``{"prompt", "observations", "reward", "terminated", "info"}`` in the
    demonstration's own shape, so ``replay_demo(d, env)["observations"] ==
    d["observations"]`` is the check that it replays exactly.
    """
    prompt, _ = env.reset(seed=seed, options={"row": demo["row"]})
    observations, reward, terminated, info = [], 0.0, False, {}
    for i, action in enumerate(demo["actions"]):
        obs, r, terminated, truncated, info = env.step(action)
        reward += r
        if terminated or truncated:
            if i != len(demo["actions"]) - 1:
                raise ValueError(f"demonstration {demo.get('uid')!r}: the episode ended after "
                                 f"action {i} of {len(demo['actions'])}")
            break
        observations.append(obs)
    return {"prompt": prompt, "observations": observations, "reward": reward,
            "terminated": bool(terminated), "info": info}


def filter_trajectories(records: list[dict], min_reward: float, max_per_prompt: int = 0,
                        require_terminated: bool = True) -> list[dict]:
    """Rejection sampling: rollout records whose reward is at least ``min_reward`` (and
    that ended with an answer, unless ``require_terminated`` is False); at most
    ``max_per_prompt`` per prompt uid (0 = all), keeping the first ones."""
    kept, per_uid = [], {}
    for r in records:
        if record_kind(r) != "trajectory":
            raise ValueError("agentgym filter reads trajectory records (from agentgym "
                             f"rollout); got a {record_kind(r)}")
        if float(r.get("reward", 0.0)) < min_reward:
            continue
        if require_terminated and not r.get("terminated", False):
            continue
        uid = r.get("uid", "")
        if max_per_prompt and per_uid.get(uid, 0) >= max_per_prompt:
            continue
        per_uid[uid] = per_uid.get(uid, 0) + 1
        kept.append(r)
    return kept
