"""Toy environments shipped with the tests (learning tests need a fast, learnable reward)."""

from __future__ import annotations

import threading
import uuid

from agentgym.envs.base import AgentEnv


class Gate:
    """A test's hand on a Talk episode (fault injection: a tool call that waits): a row
    with ``extra_info.gate = gate.name`` blocks in each tool call until the test calls
    :meth:`open`; ``arrived`` is set when an episode first gets there. What a test needs
    to happen between two turns of an episode (a weight update, a producer restart) then
    happens there by construction, not by timing."""

    registry: dict[str, "Gate"] = {}

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.name = uuid.uuid4().hex
        self.arrived, self._open = threading.Event(), threading.Event()
        self.timeout_s = timeout_s
        Gate.registry[self.name] = self

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Open for good and forget (a test's ``finally``: no tool call stays blocked)."""
        self._open.set()
        Gate.registry.pop(self.name, None)

    def wait(self) -> None:
        self.arrived.set()
        if not self._open.wait(self.timeout_s):
            raise TimeoutError(f"gate {self.name} stayed shut for {self.timeout_s} s")


class LetterEnv(AgentEnv):
    """One turn: the reward is the fraction of the reply's characters that are 'e'.

    A random-init model scores near the letter's background frequency; a policy that
    learns to emit 'e'-heavy tokens scores far higher, so GRPO's progress is visible in
    a few steps. A row with ``extra_info.constant_reward`` pays that reward whatever the
    reply (every sample of such a prompt gets the same reward: no learning signal).
    """

    observation_format = "inline"
    stop_strings = ("\n\n",)

    def __init__(self, max_turns: int = 1) -> None:
        super().__init__(max_turns=max_turns)

    def _reset(self, row):
        self._constant = ((row or {}).get("extra_info") or {}).get("constant_reward")
        prompt = row["prompt"] if row else [{"role": "user", "content": "Write something."}]
        return [dict(m) for m in prompt], {}

    def _step(self, action, last_turn):
        text = action.replace("<|im_end|>", "")
        reward = text.count("e") / max(1, len(text))
        if self._constant is not None:
            reward = float(self._constant)
        return [], reward, True, {"em": float(reward > 0.5)}


def letter_rows(n: int) -> list[dict]:
    return [{"data_source": "toy", "prompt": [{"role": "user", "content": f"Write text #{i}."}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "e"},
             "extra_info": {"index": i}, "env": "agentgym-test/Letter-v0"} for i in range(n)]


class TalkEnv(AgentEnv):
    """Several turns: every reply is answered with the same short message, until the
    turn budget ends the episode (truncated). Reward 0.1 per turn. A multi-turn
    workload for engine routing tests."""

    observation_format = "inline"
    stop_strings = ("\n\n",)

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__(max_turns=max_turns)

    def _reset(self, row):
        prompt = row["prompt"] if row else [{"role": "user", "content": "Talk to me."}]
        extra = (row or {}).get("extra_info") or {}
        self._delay = float(extra.get("delay", 0.0))
        self._gate = Gate.registry.get(extra["gate"]) if extra.get("gate") else None
        return [dict(m) for m in prompt], {}

    def _step(self, action, last_turn):
        if self._gate is not None:
            self._gate.wait()
        if self._delay:  # a slow tool (extra_info.delay seconds per step)
            import time
            time.sleep(self._delay)
        return [{"role": "user", "content": "\nGo on.\n"}], 0.1, False, {}


class LevelEnv(AgentEnv):
    """One turn, a reward scripted by the row's ``extra_info.level``: level 1 is always
    solved, level 3 never, level 2 about half the time (the parity of a checksum of the
    reply, which a random-init model's sampling spreads evenly). A curriculum test's
    task: level 1 above any band, level 2 inside it, level 3 below it."""

    observation_format = "inline"
    stop_strings = ("\n\n",)

    def __init__(self, max_turns: int = 1) -> None:
        super().__init__(max_turns=max_turns)

    def _reset(self, row):
        self._level = ((row or {}).get("extra_info") or {}).get("level", 2)
        prompt = row["prompt"] if row else [{"role": "user", "content": "Write something."}]
        return [dict(m) for m in prompt], {}

    def _step(self, action, last_turn):
        import zlib
        solved = {1: 1.0, 3: 0.0}.get(self._level, float(zlib.crc32(action.encode()) % 2))
        return [], solved, True, {"em": solved}


def level_rows(per_level: int, levels=(1, 2, 3)) -> list[dict]:
    return [{"data_source": "toy", "prompt": [{"role": "user", "content": f"Level {lv} #{i}."}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i, "level": lv}, "env": "agentgym-test/Level-v0"}
            for lv in levels for i in range(per_level)]


class TwoStepEnv(AgentEnv):
    """Two turns. The first reply is scored by its share of 'e' when the row's
    ``extra_info.turn_reward`` is true (else 0); the second by a coin: the parity of a
    checksum of the reply, which no policy here can steer. The outcome alone is thus
    uninformative about the first turn, its turn reward is not: turn-level credit's task.
    ``info["em"]`` carries the first turn's 'e' share, what a comparison judges."""

    observation_format = "inline"
    stop_strings = ("\n\n",)

    def __init__(self, max_turns: int = 2) -> None:
        super().__init__(max_turns=max_turns)

    def _reset(self, row):
        self._turn_reward = bool(((row or {}).get("extra_info") or {}).get("turn_reward"))
        self._share = 0.0
        prompt = row["prompt"] if row else [{"role": "user", "content": "Write something."}]
        return [dict(m) for m in prompt], {}

    def _step(self, action, last_turn):
        import zlib
        text = action.replace("<|im_end|>", "")
        if not last_turn:
            self._share = text.count("e") / max(1, len(text))
            reward = self._share if self._turn_reward else 0.0
            return [{"role": "user", "content": "\nNow answer.\n"}], reward, False, {}
        return [], float(zlib.crc32(action.encode()) % 2), True, {"em": self._share}


def two_step_rows(n: int, turn_reward: bool) -> list[dict]:
    return [{"data_source": "toy", "prompt": [{"role": "user", "content": f"Write text #{i}."}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i, "turn_reward": turn_reward},
             "env": "agentgym-test/TwoStep-v0"} for i in range(n)]


#: released by tests/test_stalls.py when it ends, so no thread stays blocked
STALL_RELEASE = threading.Event()


def stall_forever() -> None:
    """What a hung tool or reward does: wait on something that never comes."""
    STALL_RELEASE.wait()


class StallingLetterEnvFault(LetterEnv):
    """Fault injection: a row with ``extra_info.stall`` makes the env's step (its reward)
    block forever (until the test releases :data:`STALL_RELEASE`), one with
    ``extra_info.stall_reset`` its reset; other rows are :class:`LetterEnv`'s."""

    def _reset(self, row):
        extra = (row or {}).get("extra_info") or {}
        self._stall = bool(extra.get("stall"))
        if extra.get("stall_reset"):
            stall_forever()
        return super()._reset(row)

    def _step(self, action, last_turn):
        if self._stall:
            stall_forever()
        return super()._step(action, last_turn)


#: how many of the next :class:`StallingLetterEnvFault` constructions block forever
STALLING_MAKES = [0]
_MAKES_LOCK = threading.Lock()


class StallingMakeLetterEnvFault(StallingLetterEnvFault):
    """Fault injection: while :data:`STALLING_MAKES` is above 0, each construction takes
    one and blocks forever (until the test releases :data:`STALL_RELEASE`)."""

    def __init__(self, max_turns: int = 1) -> None:
        with _MAKES_LOCK:
            stall, STALLING_MAKES[0] = STALLING_MAKES[0] > 0, max(STALLING_MAKES[0] - 1, 0)
        if stall:
            stall_forever()
        super().__init__(max_turns)


def reward_that_never_returns_fault(data_source, solution_str, ground_truth, extra_info=None):
    """Fault injection (``reward=toy_envs:reward_that_never_returns_fault``): a reward
    function, verl's signature, that blocks forever on a row with ``extra_info.stall_reward``
    (until the test releases :data:`STALL_RELEASE`) and pays the reply's length otherwise."""
    if (extra_info or {}).get("stall_reward"):
        stall_forever()
    return len(solution_str) / 100.0
