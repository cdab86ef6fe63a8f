"""A small OpenEnv environment written with ``openenv-core``'s own server helpers, the
default server of ``env=openenv`` (no ``openenv.url`` or ``openenv.app``) and the one its
tests run: guess a whole number from 1 to 20, told "higher" or "lower" after each wrong
guess; reward 1.0 for the right one. ``reset(seed)`` picks the number from the seed.

    uvicorn agentgym.tools.openenv_guess:app --port 8000
"""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

HIGHEST = 20
PROMPT = (f"I picked a whole number from 1 to {HIGHEST}. Guess it: reply with the JSON "
          f'action {{"guess": N}}. After a wrong guess I say whether it is higher or lower.')


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._target = random.Random(seed).randint(1, HIGHEST)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(message=PROMPT, reward=0.0, done=False)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._target:
            return GuessObservation(message=f"{action.guess} is right.", reward=1.0, done=True)
        hint = "higher" if action.guess < self._target else "lower"
        return GuessObservation(message=f"{action.guess} is wrong: the number is {hint}.",
                                reward=0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=64)
