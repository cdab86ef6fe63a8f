"""Host memory that a long CPU run gives back, without paying for it in every allocation.

glibc's ``malloc`` serves a large block from ``mmap`` (returned to the system on ``free``)
only above a threshold that it raises, by default, to the size of every mmapped block
freed (up to 32 MiB). A training process frees tensors of many sizes step after step (KV
caches, activations, logits), so after a few steps most of them come from the heap, whose
freed holes stay in the process: its RSS only grows. Measured on the issue 21 long runs
(smollm2-135m, search, 64 trajectories a step, 24 GiB machine): 9 → 15 → 20.6 GiB RSS over
16 GRPO steps, until the OOM killer stopped the other run.

The first fix set the threshold at 128 KiB: every block above it was mmapped and
unmapped again, so each of a step's activations came back as fresh pages, faulted in and
zeroed by the kernel: 172 million page faults and 374 s of system time in one 13-minute
``make demo`` (issue 56), its SFT steps 1.5-1.8x slower than with the heap reused. Now
(docs/decisions/reliability.md, "CPU memory that long runs give back"):

* :func:`return_freed_memory` (at start-up) fixes the mmap threshold at 32 MiB, the most
  glibc accepts, and stops ``free`` trimming the heap's top on its own, so a step reuses
  the memory its previous allocations freed;
* :func:`give_back` (at the end of every training and SFT step, in the driver and in each
  rank process) hands the heap's free pages back to the system with ``malloc_trim(0)``
  when the process ends a step above the highest RSS that a step begun from a returned
  heap ended at (:class:`Keeper`): glibc's heap does not stay the size a step needs, it
  creeps by 2-3 GiB a step at the demo's update (its holes do not fit the next step's
  blocks), so it must be returned now and then, but returning it after every step made
  the next step fault its whole working set in again (2.5 million faults and 24-45 s of
  system time a step there). Now it is returned every second step or so, and between
  steps the RSS stays under what a step begun from a returned heap needs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import psutil

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
#: blocks above this come from mmap (glibc refuses more than 32 MiB on 64-bit)
THRESHOLD = 32 * 1024 * 1024
#: free's own trimming of the heap's top, off below 2 GiB (mallopt takes an int): give_back
#: trims between steps
TRIM_THRESHOLD = 2**31 - 1


@functools.cache
def _libc():
    """glibc, or None (another OS, or a libc without mallopt/malloc_trim such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` and its trim threshold at
    :data:`TRIM_THRESHOLD`, so a step's freed blocks are reused by the next allocations
    rather than unmapped and faulted in again; :func:`give_back` returns them between
    steps. True if set; False off glibc Linux or where the user chose a threshold
    (``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the environment)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if ok:
        logger.debug("glibc mmap threshold %d bytes, trim threshold %d", THRESHOLD,
                     TRIM_THRESHOLD)
    return ok


class Keeper:
    """When to return the heap's free pages: when a step ends above :attr:`ceiling`, the
    highest RSS at which a step begun from a returned heap ended (what one step needs).
    A step begun from a kept heap reuses its pages without faults, and its fragments
    push the RSS above the ceiling within a step or two; a step begun from a returned
    heap faults its working set in again and may raise the ceiling."""

    def __init__(self) -> None:
        #: the highest RSS at which a step begun from a returned heap ended (bytes)
        self.ceiling = 0
        #: whether the step now running began from a returned heap (a new process's has)
        self.fresh = True

    def step_end(self, rss: int) -> bool:
        """Whether to return the heap now, at the end of a step with ``rss`` resident."""
        if self.fresh:
            self.ceiling = max(self.ceiling, rss)
        self.fresh = rss > self.ceiling
        return self.fresh


_KEEPER = Keeper()


def give_back() -> bool:
    """At the end of a step: return the heap's free pages to the system
    (``malloc_trim(0)``: its top and every whole free page inside it) when the process is
    above the RSS a step needs (:class:`Keeper`), and keep them for the next step
    otherwise; the trim itself takes up to a second after a multi-GiB step. True if
    memory was returned; False when it was kept, there was none to return, or off glibc."""
    libc = _libc()
    if libc is None or not _KEEPER.step_end(psutil.Process().memory_info().rss):
        return False
    return bool(libc.malloc_trim(0))
