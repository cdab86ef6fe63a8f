"""The environment contract: Gymnasium-style envs whose actions and observations are text.

Every AgentGym environment subclasses :class:`AgentEnv` and obeys this contract
(``agentgym.envs.check_env`` verifies it; the tests run it over every registered env):

* ``reset(*, seed=None, options=None) -> (observation, info)``. The dataset row arrives as
  ``options["row"]`` (verl format). Without a row the env picks one of its built-in
  examples with ``self.np_random``, so ``reset(seed=s)`` is deterministic.
* ``step(action: str) -> (observation, reward, terminated, truncated, info)``.
  ``terminated`` means the episode reached a natural end (an answer); ``truncated`` means a
  budget (turns) ran out. They stay separate because PPO bootstraps differently on them.
  Stepping an ended episode raises ``RuntimeError``.
* Observations are lists of chat messages (``{"role", "content"}``). How they enter the
  token stream is ``observation_format``: ``"inline"`` (the content continues the
  assistant's text, as in Search-R1 / ReTool) or ``"chat"`` (new messages rendered through
  the chat template). After the episode ends the observation is an empty list.
* ``stop_strings``: generation stops when one of these is produced, so the env can act.
* ``tools``: OpenAI function schemas; the prompt renders them through the chat template
  (or a system message) and the env parses Hermes ``<tool_call>`` blocks
  (:mod:`agentgym.envs.function_calling`), answering each with a ``tool`` message.
* A tool failure (timeout, dead server, sandbox error) or a malformed action becomes an
  observation plus a counter in ``info``; it never raises out of ``step``. A failure that
  is not the policy's doing (the service unreachable, a 5xx, the service's own timeout, a
  sandbox that crashed or was killed by the host) is also reported with
  :meth:`AgentEnv.infra_failure`: ``info["infra_failures"]`` and ``info["infra_error"]``
  mark the episode, so training can replay or drop it (``rollout.on_infra_error``) rather
  than learn from the infrastructure's failure. A malformed call stays the policy's.
* Rewards are finite Python floats; ``close()`` may be called any number of times.

Subclasses implement :meth:`_reset` and :meth:`_step`; this base class does the
bookkeeping (turn counting, the turn budget, ended-episode checks, info counters).

That is all an env class is. What the trainer asks of an env beyond its episodes (config
sections, presets, datasets, row filter, demonstrations, constructor arguments from the
config) is the env module's ``MANIFEST`` (:mod:`agentgym.envs.manifest`).
"""

from __future__ import annotations

import abc
import string
from typing import Any, Literal

import gymnasium

from agentgym.envs.manifest import manifest_of, max_turns_of

ROLES = ("system", "user", "assistant", "tool")
#: Every printable character plus the usual whitespace: actions are free text.
FULL_CHARSET = string.printable


class TextSpace(gymnasium.Space):
    """Free text up to ``max_length`` characters (any characters, not just alphanumerics)."""

    def __init__(self, max_length: int = 100_000, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(0, 64))
        chars = self.np_random.choice(list(FULL_CHARSET), size=n)
        return "".join(chars.tolist())

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


class MessagesSpace(gymnasium.Space):
    """A list of chat messages ``{"role": ..., "content": str | list[part]}``."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict]:
        text = TextSpace(seed=int(self.np_random.integers(2**31))).sample()
        return [{"role": "user", "content": text}]

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(is_message(m) for m in x)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "MessagesSpace()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace)


def is_message(m: Any) -> bool:
    """True if ``m`` is a chat message with a valid role and text or parts content."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        return False
    content = m.get("content")
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("text", "image") for p in content)


class NotSteppable(RuntimeError):
    """Raised by an env that is registered but not stepped here (``env=agent``: the user's
    program plays its rows); checks report such an env as skipped."""


#: what an env class declared before its module's ``MANIFEST`` did (agentgym.envs.manifest):
#: a class that still sets one is refused, not silently ignored
_MANIFEST_NAMES = ("config_sections", "config_kwargs", "from_config", "presets", "datasets",
                   "row_filter", "filter_rows", "demonstrate", "demo_options", "demo_requires",
                   "demo_refusal", "episode_metrics", "tool_calls_label", "plays_any_rows",
                   "played_by_program")


class AgentEnv(gymnasium.Env, abc.ABC):
    """Base class of every AgentGym environment (see the module docstring for the contract).

    Args:
        max_turns: number of actions after which an unfinished episode is truncated; None:
            the env's own (:func:`~agentgym.envs.manifest.max_turns_of`: its manifest's
            preset, else the config's default).
    """

    metadata = {"render_modes": []}
    observation_format: Literal["inline", "chat"] = "inline"
    stop_strings: tuple[str, ...] = ()
    #: OpenAI function schemas the prompt offers (envs.function_calling); None: no tools
    tools: list[dict] | None = None
    #: info keys of this episode's last step that rollouts average into their metrics:
    #: the manifest's (:attr:`agentgym.envs.manifest.EnvManifest.episode_metrics`), set by
    #: :meth:`reset`; ``_reset`` may name more for one episode (the search env's multi-hop
    #: rows)
    episode_metrics: tuple[str, ...] = ()
    #: the registered id and short name the class statement gave (``env_id=``, ``short=``)
    env_id: str | None = None
    env_short: str | None = None

    def __init_subclass__(cls, env_id: str | None = None, short: str | None = None,
                          **kwargs) -> None:
        """``class MyEnv(AgentEnv, env_id="me/My-v0", short="my")`` names the env: a
        module of ``envs/`` that defines it is registered under that id and short name when
        the package is imported (:func:`agentgym.envs.registration.discover_envs`)."""
        super().__init_subclass__(**kwargs)
        if moved := [name for name in _MANIFEST_NAMES if name in vars(cls)]:
            raise TypeError(f"{cls.__name__} sets {', '.join(moved)}: what the trainer asks of "
                            f"an env is its module's MANIFEST = EnvManifest(...) "
                            f"(agentgym.envs.manifest, docs/ENVS.md)")
        if env_id is not None:
            cls.env_id, cls.env_short = env_id, short

    def __init__(self, max_turns: int | None = None) -> None:
        if max_turns is None:
            max_turns = max_turns_of(type(self))
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.action_space = TextSpace()
        self.observation_space = MessagesSpace()
        self._turn = 0
        self._ended = True
        self._started = False
        self._counters: dict[str, int] = {}
        self._infra_error = ""

    # -- subclass hooks -----------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, row: dict | None) -> tuple[list[dict], dict]:
        """Start an episode for ``row`` (None: pick a built-in example with np_random)."""

    @abc.abstractmethod
    def _step(self, action: str, last_turn: bool) -> tuple[list[dict], float, bool, dict]:
        """Act; return ``(observation, reward, terminated, info)``.

        ``last_turn`` is True when this is the final allowed turn: the base class then
        truncates unless the subclass terminates. Use :meth:`count` for counters.
        """

    # -- gymnasium API ------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        row = (options or {}).get("row")
        self._turn = 0
        self._ended = False
        self._started = True
        self._counters = {"tool_calls": 0, "tool_failures": 0, "malformed_actions": 0,
                          "infra_failures": 0}
        self._infra_error = ""
        self.episode_metrics = manifest_of(type(self)).episode_metrics
        obs, info = self._reset(row)
        return obs, {**info, **self._counters}

    def step(self, action: str):
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if self._ended:
            raise RuntimeError(f"{type(self).__name__}.step() called after the episode "
                               "ended; call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        self._turn += 1
        last = self._turn >= self.max_turns
        obs, reward, terminated, info = self._step(action, last)
        truncated = bool(last and not terminated)
        self._ended = bool(terminated or truncated)
        if self._ended:
            obs = []
        info = {**info, **self._counters, "turn": self._turn}
        if self._ended and self.episode_metrics:
            info["episode_metrics"] = list(self.episode_metrics)
        if self._infra_error:
            info["infra_error"] = self._infra_error
        return obs, float(reward), bool(terminated), truncated, info

    def count(self, name: str, k: int = 1) -> None:
        """Increase an episode counter reported in every ``info`` (e.g. tool_failures)."""
        self._counters[name] = self._counters.get(name, 0) + k

    def infra_failure(self, reason: str) -> None:
        """Mark this episode: a tool failed for a reason that is not the policy's (see the
        module docstring). Counts ``infra_failures``; the first reason is kept in
        ``info["infra_error"]``. The caller still counts ``tool_failures`` and answers with
        an observation as for any tool failure."""
        self.count("infra_failures")
        self._infra_error = self._infra_error or reason[:500]

    def pick_row(self, rows: list[dict]) -> dict:
        """A deterministic (given the reset seed) choice among built-in example rows."""
        return rows[int(self.np_random.integers(len(rows)))]

    def close(self) -> None:  # idempotent by contract; subclasses extend
        super().close()

