"""``check_env``: verify an environment obeys the AgentGym contract (see ``agentgym.envs.base``).

Hard violations raise :class:`EnvContractError` with what was wrong and how to fix it;
doubtful behaviour only warns. The test suite runs this over every registered env and
over deliberately broken envs to prove each check can fail.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Iterator

from agentgym.envs.base import NotSteppable, is_message
from agentgym.envs.registration import env_manifest, make_env, resolve_env_id
from agentgym.tools.errors import MissingExtra

# Actions that exercise malformed, unfinished and answering paths of text envs.
PROBE_ACTIONS = ("this is not a valid action", "<answer> unknown </answer>")


class EnvContractError(AssertionError):
    """An environment broke the AgentGym environment contract."""


def _fail(env: Any, what: str, fix: str) -> None:
    raise EnvContractError(f"{type(env).__name__}: {what}. {fix}")


def _check_obs(env: Any, obs: Any, where: str, allow_empty: bool) -> None:
    if not isinstance(obs, list):
        _fail(env, f"{where} returned observation of type {type(obs).__name__}",
              "Return a list of chat messages {'role', 'content'}.")
    if not obs and not allow_empty:
        _fail(env, f"{where} returned an empty observation", "reset() must return the prompt.")
    for m in obs:
        if not is_message(m):
            _fail(env, f"{where} returned a malformed message {m!r}",
                  "Each message needs role in system/user/assistant/tool and str or parts "
                  "content.")
    space = getattr(env, "observation_space", None)
    if space is not None and not space.contains(obs):
        _fail(env, f"{where} observation is not in observation_space {space}",
              "Use envs.base.MessagesSpace.")


def _check_step_return(env: Any, out: Any, where: str) -> tuple:
    if not isinstance(out, tuple) or len(out) != 5:
        _fail(env, f"{where} returned {type(out).__name__} of length "
                   f"{len(out) if hasattr(out, '__len__') else '?'}",
              "step() must return (observation, reward, terminated, truncated, info).")
    obs, reward, terminated, truncated, info = out
    if not isinstance(reward, float) or isinstance(reward, bool):
        _fail(env, f"{where} reward {reward!r} is {type(reward).__name__}",
              "Return a Python float.")
    if not math.isfinite(reward):
        _fail(env, f"{where} reward is {reward}", "Rewards must be finite.")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool):
            _fail(env, f"{where} {name}={flag!r} is {type(flag).__name__}", "Return a bool.")
    if not isinstance(info, dict):
        _fail(env, f"{where} info is {type(info).__name__}", "Return a dict.")
    _check_obs(env, obs, where, allow_empty=terminated or truncated)
    return out


def _rollout(env: Any, seed: int, actions: tuple[str, ...]) -> list:
    """Reset with ``seed`` and play ``actions`` (cycled) to the end; the full transcript."""
    obs, info = env.reset(seed=seed)
    _check_obs(env, obs, "reset()", allow_empty=False)
    if not isinstance(info, dict):
        _fail(env, f"reset() info is {type(info).__name__}", "Return (observation, dict).")
    transcript: list = [copy.deepcopy(obs)]
    for i in range(1000):
        out = _check_step_return(env, env.step(actions[i % len(actions)]), f"step #{i + 1}")
        transcript.append(copy.deepcopy(out[:4]))
        if out[2] or out[3]:
            return transcript
    _fail(env, "episode did not end after 1000 steps", "Enforce a turn budget (truncated).")
    return transcript


def check_env(env: Any, seed: int = 0, actions: tuple[str, ...] = PROBE_ACTIONS) -> None:
    """Check ``env`` against the contract; raise EnvContractError on hard violations.

    Checks: declared ``observation_format`` and ``stop_strings``; reset/step return types
    and message shapes; finite float rewards and bool flags; seeded reset and step
    determinism; step after the end raises; ``close()`` is idempotent.
    """
    fmt = getattr(env, "observation_format", None)
    if fmt not in ("inline", "chat"):
        _fail(env, f"observation_format is {fmt!r}", "Declare 'inline' or 'chat'.")
    stops = getattr(env, "stop_strings", None)
    if not isinstance(stops, tuple) or not all(isinstance(s, str) and s for s in stops):
        _fail(env, f"stop_strings is {stops!r}", "Declare a tuple of non-empty strings.")
    if not stops and fmt == "inline":
        warnings.warn(f"{type(env).__name__}: inline env without stop_strings; generation "
                      "runs to EOS before the env can act", stacklevel=2)

    for probe in (actions[:1], actions[-1:]):
        first = _rollout(env, seed, probe)
        second = _rollout(env, seed, probe)
        if first != second:
            _fail(env, f"two episodes with seed={seed} and the same actions differ",
                  "Draw all randomness from self.np_random seeded in reset().")
        try:
            env.step(probe[0])
        except (RuntimeError, AssertionError):
            pass
        else:
            _fail(env, "step() after the episode ended did not raise",
                  "Raise RuntimeError until reset() is called.")

    env.close()
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 - any error here is the violation
        _fail(env, f"a second close() raised {type(e).__name__}: {e}", "Make close idempotent.")


def check_envs(names: list[str], build_cfg: Callable[[str], Any]
               ) -> Iterator[tuple[str, str, str]]:
    """``agentgym check-env``'s verdicts, one per env name (a short name, an id or a
    plugin's class spec): ``("ok" | "skip" | "FAIL", env id, detail)``. Each is checked
    with :func:`check_env` and gymnasium's own checker; an env whose manifest has its own
    ``check`` (``env=verifiers``) runs that with ``build_cfg(name)``, the run's config; an
    optional package not installed (or ``env=agent``, not stepped here) is a skip. Every
    env is reported, whatever failed before it."""
    import gymnasium
    from gymnasium.utils.env_checker import check_env as gym_check_env


    for name in names:
        env_id = name
        try:
            env_id = resolve_env_id(name)
            manifest = env_manifest(name)
            if manifest.check is not None:
                yield "ok", env_id, str(manifest.call(manifest.check, build_cfg(name)))
                continue
            check_env(make_env(env_id))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gym_check_env(gymnasium.make(env_id).unwrapped, skip_render_check=True)
            yield "ok", env_id, f"{len(caught)} gymnasium warnings" if caught else ""
        except (MissingExtra, NotSteppable) as e:
            yield "skip", env_id, str(e)
        except Exception as e:  # noqa: BLE001 - report every env, then fail
            yield "FAIL", env_id, f"{type(e).__name__}: {e}"
