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
(docs/DECISIONS.md, "CPU memory that long runs give back"):

* :func:`return_freed_memory` (at start-up) fixes the mmap threshold at 32 MiB, the most
  glibc accepts, and stops ``free`` trimming the heap's top on its own, so a step reuses
  the memory its previous allocations freed;
* :func:`give_back` (at the end of every training and SFT step, in the driver and in each
  rank process) hands every free page of the heap back to the system with
  ``malloc_trim(0)``: between steps the RSS goes back down, as it did at 128 KiB.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

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


def give_back() -> bool:
    """Return the heap's free pages to the system (``malloc_trim(0)``: its top and every
    whole free page inside it); a few hundred ms after a multi-GiB step. True if glibc did
    release memory; False when there was none to release or off glibc."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
