"""The progress callbacks training calls (:class:`Hooks`): the CLI draws its bars and prints
from them; library code only logs."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class Hooks:
    """Progress callbacks; the CLI draws bars and prints from them (library code logs)."""

    def phase(self, name: str, total: int) -> None: ...
    def advance(self, k: int = 1) -> None: ...
    def step_end(self, step: int, metrics: dict) -> None: ...
    def announce(self, text: str) -> None:
        """A stage starts, or a fact the user should see (the CLI prints it)."""
        logger.info("%s", text)


class WatchedHooks(Hooks):
    """The run's hooks, each ``advance`` (an episode finished, a minibatch trained) also
    the watched stage's progress (``watch``: an :class:`agentgym.supervision.watchdog.Watchdog`)."""

    def __init__(self, inner: Hooks, watch) -> None:
        self.inner, self.watch = inner, watch

    def phase(self, name: str, total: int) -> None:
        self.inner.phase(name, total)

    def advance(self, k: int = 1) -> None:
        self.watch.progress()
        self.inner.advance(k)

    def step_end(self, step: int, metrics: dict) -> None:
        self.inner.step_end(step, metrics)

    def announce(self, text: str) -> None:
        self.inner.announce(text)

