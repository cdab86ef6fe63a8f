"""Host memory that a long CPU run gives back.

glibc's ``malloc`` serves a large block from ``mmap`` (returned to the system on ``free``)
only above a threshold that it raises, by default, to the size of every mmapped block
freed (up to 32 MiB). A training process frees tensors of many sizes step after step (KV
caches, activations, logits), so after a few steps most of them come from the heap, whose
freed holes stay in the process: its RSS only grows. Measured on the issue 21 long runs
(smollm2-135m, search, 64 trajectories a step, 24 GiB machine): 9 → 15 → 20.6 GiB RSS over
16 GRPO steps, until the OOM killer stopped the other run; with the threshold fixed at
128 KiB, 4–8 GiB, going back down between steps (docs/DECISIONS.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
THRESHOLD = 128 * 1024


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 128 KiB (its starting value) so freed large blocks go
    back to the system. True if set; False off glibc Linux or where the user chose a value
    (``MALLOC_MMAP_THRESHOLD_`` in the environment)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if ok:
        logger.debug("glibc mmap threshold fixed at %d bytes", THRESHOLD)
    return ok
