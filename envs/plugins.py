"""Envs and rewards from the user's own code, without a wrapper script.

- ``env=my_pkg.my_module:MyEnv``: an :class:`~agentgym.envs.base.AgentEnv` subclass importable here
  (and in Ray workers: an installed package, or on ``PYTHONPATH``) is registered on first
  use under its ``env_id`` class attribute (default ``<top package>/<ClassName>-v0``), with
  the spec itself as its short name (:func:`agentgym.envs.registration.resolve_env_id`).
- Installed packages register envs through the entry-point group ``agentgym.envs``: the
  entry point's name is the short name (``env=maze``), its value ``package.module:Class``;
  the id is ``<distribution>/<name>-v0`` unless the class sets ``env_id``. Read when
  ``envs`` is imported, so every process that imports it (Ray workers included) sees them.
- Either way, what the trainer asks of the env (its config sections, datasets, presets,
  constructor arguments …) is the ``MANIFEST`` of its class's module, as for the envs of
  this package (:mod:`agentgym.envs.manifest`; none: nothing beyond the class); its
  sections join the run's config when the run chooses the env
  (:func:`agentgym.config.add_env_sections`).
- ``reward=my_pkg.rewards:score``: a function with verl's custom-reward signature,
  ``score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
  (a dict carries ``"score"`` and any extra numbers, which go to the episode's info), that
  replaces the env's reward at the end of each episode (:class:`RewardOverride`); a module
  in the working directory needs no installing (as ``agent=``'s). With
  ``reward_process=true`` it runs in a process of its own
  (:func:`agentgym.supervision.process_call.call_in_process`): one that hangs past
  ``deadlines.env_step_s`` is killed with its process group, where a thread would be left
  behind.

docs/ENVS.md walks through writing one.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable
from agentgym.core.registry import load_entry_point
from agentgym.envs.base import AgentEnv
from agentgym.supervision.process_call import call_in_process

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "agentgym.envs"


def is_spec(name: str) -> bool:
    """Whether ``name`` looks like ``package.module:attr``."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def load_spec(spec: str, what: str) -> Any:
    """Import ``package.module:attr``; errors name the spec and what was expected."""
    if not is_spec(spec):
        raise ValueError(f"{what}={spec!r}: expected 'package.module:attr'")
    try:
        return load_entry_point(spec)
    except ImportError as e:
        raise ValueError(f"{what}={spec!r}: cannot import {spec.partition(':')[0]!r} ({e}); "
                         f"install the package or put it on PYTHONPATH") from e
    except AttributeError as e:
        raise ValueError(f"{what}={spec!r}: the module has no {spec.partition(':')[2]!r}") from e


def plugin_env_class(spec: str):
    """The :class:`~agentgym.envs.base.AgentEnv` subclass ``spec`` names (a clear error
    otherwise)."""
    cls = load_spec(spec, "env")
    if not (isinstance(cls, type) and issubclass(cls, AgentEnv)):
        raise ValueError(f"env={spec!r} is {cls!r}, not a subclass of envs.base.AgentEnv "
                         f"(see docs/ENVS.md)")
    return cls


def plugin_env_id(cls, default_namespace: str) -> str:
    """``cls.env_id`` when the class itself sets one (not one it inherits from a built-in
    env it extends), else ``<namespace>/<ClassName>-v0``."""
    env_id = vars(cls).get("env_id")
    if env_id:
        return env_id
    namespace = "".join(c if c.isalnum() or c in "._-" else "-" for c in default_namespace)
    return f"{namespace}/{cls.__name__}-v0"


def entry_point_envs() -> list[tuple[str, str, str]]:
    """``(short name, 'package.module:Class', distribution name)`` of every installed
    ``agentgym.envs`` entry point."""
    from importlib.metadata import entry_points
    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        out.append((ep.name, ep.value, dist.name if dist is not None else "plugin"))
    return out


@functools.lru_cache(maxsize=None)
def load_reward(spec: str) -> Callable:
    """The reward function ``spec`` names, checked to be callable; the working directory
    is searched too (as ``agent=``'s, :func:`agentgym.serving.agents.load_agent`)."""
    import os
    import sys
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    fn = load_spec(spec, "reward")
    if not callable(fn):
        raise ValueError(f"reward={spec!r} is {type(fn).__name__}, not a function")
    return fn


class RewardOverride:
    """An env whose episode reward comes from ``reward`` (a ``package.module:function``
    spec) instead of its own: every step's reward is 0 but the last, which is
    ``score(data_source, solution_str, ground_truth, extra_info)`` over the row and the
    episode's text (the model's actions with the observations between them, as the
    response reads). The env's own reward is kept in ``info["env_reward"]``. A function
    that raises or returns no finite number scores 0, with the reason in
    ``info["reward_error"]`` and the ``reward_failures`` counter, and a logged warning.
    Everything else is the wrapped env's."""

    def __init__(self, env, reward, process: bool = False) -> None:
        """``reward``: a ``package.module:function`` spec, or the function itself (a
        picklable callable, e.g. :class:`agentgym.envs.judge.JudgeReward`); ``process``:
        each call in a process of its own (``reward_process=true``)."""
        self.env = env
        self.fn = reward if callable(reward) else load_reward(reward)
        self.spec = getattr(reward, "name", None) or str(reward)
        self.process = process
        self._row: dict = {}
        self._text: list[str] = []
        self._env_reward = 0.0

    @classmethod
    def wrap(cls, make: Callable[[], Any], reward, process: bool = False):
        """A factory's env, wrapped (picklable as ``partial(RewardOverride.wrap, ...)``)."""
        return cls(make(), reward, process)

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._row = dict((options or {}).get("row") or {})
        self._text, self._env_reward = [], 0.0
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._env_reward += float(reward)
        self._text.append(action)
        for message in obs:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                self._text.append(content)
        if not (terminated or truncated):
            return obs, 0.0, terminated, truncated, info
        score, extra = self._score("".join(self._text))
        return obs, score, terminated, truncated, {**info, **extra,
                                                   "env_reward": self._env_reward}

    def _score(self, text: str) -> tuple[float, dict]:
        row = self._row
        ground_truth = (row.get("reward_model") or {}).get("ground_truth")
        args = (row.get("data_source", ""), text, ground_truth, row.get("extra_info") or {})
        try:
            if self.process:
                out = call_in_process(self.fn, *args)
            else:
                out = self.fn(*args)
            extra = {}
            if isinstance(out, dict):
                extra = {k: v for k, v in out.items() if k != "score"
                         and isinstance(v, (int, float, str, bool))}
                out = out.get("score")
            score = float(out)
            if not math.isfinite(score):
                raise ValueError(f"returned {out!r}")
            return score, extra
        except Exception as e:  # the user's code: its failure scores 0 and says why
            reason = f"{type(e).__name__}: {e}"
            logger.warning("reward %s failed (%s); scoring the episode 0", self.spec, reason)
            counters = getattr(self.env, "_counters", None)
            if isinstance(counters, dict):
                counters["reward_failures"] = counters.get("reward_failures", 0) + 1
            return 0.0, {"reward_error": reason[:500], "reward_failures": 1}

    def close(self) -> None:
        self.env.close()
