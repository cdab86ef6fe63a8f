"""An episode's token ids and loss mask, written turn by turn: the one writer.

Whoever played the episode, its :class:`~agentgym.core.types.Trajectory` is written here:
the generation manager's rollouts (:mod:`agentgym.rollout.manager`), demonstrations
tokenized for SFT (:func:`agentgym.data.demos.demo_to_trajectory`) and an OpenAI-SDK
agent's recorded calls (:func:`agentgym.serving.agents.trajectories`). The masking rule:

* the prompt: mask 0 (``prompt``);
* an action: the ids the policy sampled, with the engine's logprobs, or an action written
  as text (a demonstration) tokenized as the policy would sample it
  (:meth:`~agentgym.rollout.chat.ChatTokens.action_ids`), logprob 0: mask 1
  (``generated``); a demonstration's action that is played but not learned (``played``,
  :meth:`~TrajectoryWriter.written` with ``learn=False``): mask 0;
* what follows an action before the next one: the chat template's filler that closes the
  assistant turn (``filler``) and the env's observation (``observation``), both by
  :meth:`~agentgym.rollout.chat.ChatTokens.after_action_ids`, the rule rollouts and SFT
  share; or the tokens an agent's next call adds to the ids written so far (one
  ``observation``): mask 0.

Tokens the model sampled are never decoded and re-encoded: the stream is built by
appending, so the trainer sees exactly the ids the engine sampled.
"""

from __future__ import annotations

from agentgym.core.types import Trajectory
from agentgym.rollout.chat import ChatTokens


class TrajectoryWriter:
    """Appends one trajectory's segments (ids, mask and logprobs follow from each segment's
    kind: :meth:`Trajectory.append`).

    Args:
        traj: the trajectory written to (``self.traj``).
        chat: the policy's chat-template arithmetic; needed for actions written as text
            and for observations given as messages.
        fmt: the env's ``observation_format``: ``inline`` or ``chat``.
    """

    def __init__(self, traj: Trajectory, chat: ChatTokens | None = None,
                 fmt: str = "chat") -> None:
        self.traj, self.chat, self.fmt = traj, chat, fmt

    def prompt(self, ids: list[int], turn: int = 0) -> None:
        """The prompt (mask 0): the reset messages rendered, a recorded call's prompt, or
        the context a rewrite of the history left (:mod:`agentgym.rollout.context`)."""
        self.traj.append("prompt", ids, turn)

    def sampled(self, ids: list[int], logprobs: list[float], turn: int) -> None:
        """Ids the policy sampled in ``turn``, with their logprobs (mask 1)."""
        self.traj.append("generated", ids, turn, logprobs)

    def written(self, text: str, turn: int, stop_strings: tuple[str, ...] = (),
                learn: bool = True) -> list[int]:
        """An action written as text (a demonstration), as the policy would have sampled it
        (its EOS appended unless it ends with a stop string), logprob 0: mask 1, or with
        ``learn=False`` mask 0 (``played``: in the context, not learned). Returns its ids."""
        ids = self.chat.action_ids(text, stop_strings)
        if learn:
            self.traj.append("generated", ids, turn, [0.0] * len(ids))
        else:
            self.traj.append("played", ids, turn)
        return ids

    def after_action(self, action_ids: list[int], observation: list[dict], turn: int,
                     max_response: int | None = None) -> tuple[list[int], list[int]] | None:
        """What follows the action ``action_ids``: the filler closing its turn, then the
        ``observation`` messages (both mask 0). With ``max_response``, nothing is written
        when the response would reach that many tokens with them (no room left for another
        action), and None is returned. Returns ``(filler ids, observation ids)``."""
        filler, obs_ids = self.chat.after_action_ids(action_ids, observation, self.fmt)
        if max_response is not None and \
                self.traj.response_length + len(filler) + len(obs_ids) >= max_response:
            return None
        self.traj.append("filler", filler, turn)
        self.traj.append("observation", obs_ids, turn)
        return filler, obs_ids

    def observation(self, ids: list[int], turn: int) -> None:
        """Observation ids already tokenized (mask 0), such as a request to summarize."""
        self.traj.append("observation", ids, turn)

    def extend(self, prompt_ids: list[int], turn: int) -> bool:
        """A next call's prompt: when it starts with the ids written so far, the rest goes
        in as one observation (mask 0) and True is returned; else nothing is written and
        False is returned (the caller starts a new trajectory)."""
        known = self.traj.token_ids
        if prompt_ids[:len(known)] != known:
            return False
        self.observation(prompt_ids[len(known):], turn)
        return True
