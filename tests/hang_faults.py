"""Fault injection for tests/test_hung_calls.py: reward functions (verl's signature) and
agents that never return, each its own way. A row's ``extra_info.hang`` set makes it hang;
other rows pay 0.5. The spinning and deadlocked ones are released by :func:`release` when
their test ends, so no thread of the test process stays busy or blocked."""

from __future__ import annotations

import asyncio
import threading
import time

#: set by release(): the spinning reward stops spinning
SPIN_RELEASE = threading.Event()
#: the locks the deadlocked rewards wait on a second time; release() lets them go
HELD: list[threading.Lock] = []
#: set by release(): a hung agent's wait ends
AGENT_RELEASE = threading.Event()


def release() -> None:
    SPIN_RELEASE.set()
    AGENT_RELEASE.set()
    while HELD:
        HELD.pop().release()


def arm() -> None:
    SPIN_RELEASE.clear()
    AGENT_RELEASE.clear()


def _hangs(extra_info) -> bool:
    return bool((extra_info or {}).get("hang"))


def reward_that_sleeps_fault(data_source, solution_str, ground_truth, extra_info=None):
    if _hangs(extra_info):
        time.sleep(10_000)
    return 0.5


def reward_that_spins_fault(data_source, solution_str, ground_truth, extra_info=None):
    n = 0
    while _hangs(extra_info) and not SPIN_RELEASE.is_set():
        n += 1  # the CPU, busy
    return 0.5


def reward_that_deadlocks_fault(data_source, solution_str, ground_truth, extra_info=None):
    if _hangs(extra_info):
        lock = threading.Lock()
        lock.acquire()
        HELD.append(lock)
        lock.acquire()  # a second acquire of a lock it holds: it waits for itself
    return 0.5


def agent_that_hangs_fault(row, client) -> float:
    """One call to its endpoint, then (on a hanging row) a wait that never ends."""
    client.chat.completions.create(model="policy", max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
    if _hangs(row.get("extra_info")):
        AGENT_RELEASE.wait()
    return 1.0


async def async_agent_that_hangs_fault(row, client) -> float:
    """The coroutine form: one call, then an await that never ends."""
    await client.chat.completions.create(model="policy", max_tokens=4,
                                         messages=[{"role": "user", "content": "Hi"}])
    if _hangs(row.get("extra_info")):
        await asyncio.get_running_loop().create_future()
    return 1.0
