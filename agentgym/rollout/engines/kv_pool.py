"""The keys and values of the running requests: one slot per request, allocated once.

One tensor holds them all, ``kv`` ``(layers, 2, slots + 1, kv_heads, capacity, head_dim)``,
so a join, a move or a read for the prefix cache is one copy, not one per layer; per
layer, ``k[layer]`` and ``v[layer]`` are its views ``(slots + 1, kv_heads, capacity,
head_dim)``:
slot ``s`` holds its request's positions ``0 .. length[s] - 1`` at columns of the same
index, so a position's column never moves and the attention mask of a row is simply
``column <= position``. The last slot is scratch: padded tokens write there, so a padded
batch never touches a live row.

Live rows are kept in slots ``0 .. live - 1`` (compact): a decode step works on the leading
slots as one view, with no gather. When a row leaves, the last row moves into its slot
(one copy of its filled columns).

Allocated once when :meth:`allocate` is given the final size (a CUDA graph captures the
buffers' addresses); on the CPU the pool grows instead (``growable``), doubling its columns
or slots when a request needs more, so memory follows use.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class KVPool:
    """Slots of keys/values for ``n_layers`` layers; ``rows[s]`` is slot ``s``'s owner."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device, slots: int, capacity: int, growable: bool) -> None:
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device, self.growable = dtype, device, growable
        self.kv: torch.Tensor | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows: list[object] = []  # owners of slots 0 .. live - 1
        self.length: list[int] = []  # filled positions of slots 0 .. live - 1
        self.slots = self.capacity = 0
        self.grown = 0
        self._allocate(slots, capacity)

    @property
    def live(self) -> int:
        return len(self.rows)

    @property
    def scratch(self) -> int:
        """The slot padded tokens write to."""
        return self.slots

    def bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def _allocate(self, slots: int, capacity: int) -> None:
        shape = (self.n_layers, 2, slots + 1, self.kv_heads, capacity, self.head_dim)
        new = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.kv is not None and self.live:  # live rows keep their columns
            n = max(self.length, default=0)
            new[:, :, :self.live, :, :n] = self.kv[:, :, :self.live, :, :n]
        self._use(new)
        self.slots, self.capacity = slots, capacity

    def _use(self, kv: torch.Tensor | None) -> None:
        self.kv = kv
        # one select each, not unbind: unbind's views may not be written in place
        self.k = [] if kv is None else [kv[i, 0] for i in range(self.n_layers)]
        self.v = [] if kv is None else [kv[i, 1] for i in range(self.n_layers)]

    def ensure(self, rows: int, positions: int) -> None:
        """Room for ``rows`` live slots of up to ``positions`` columns each."""
        if rows <= self.slots and positions <= self.capacity:
            return
        if not self.growable:
            raise ValueError(f"the KV pool holds {self.slots} requests of {self.capacity} "
                             f"positions; this one needs {positions} positions (raise "
                             "engine.max_len, or lower the request's prompt or max_new_tokens)")
        # the dimension that grows doubles; when the columns grow, the slots are sized to
        # the live rows, not to their largest so far: a pool that once held 64 short rows
        # and now holds 8 long ones reallocates 8 slots of the longer columns, not 64 (in
        # fp32, smollm2-135m's 64 x 2,048 positions are 6 GB: seconds of zeroing on the
        # CPU). The columns never shrink here: the next decode step would grow them back.
        slots = self.slots if rows <= self.slots else _doubled(self.slots, rows, 4)
        capacity = self.capacity
        if positions > self.capacity:
            capacity = _doubled(self.capacity, positions, 256)
            slots = min(slots, _doubled(0, max(rows, self.live), 4))
        self.grown += 1
        logger.debug("KV pool grows to %d slots x %d positions", slots, capacity)
        self._allocate(slots, capacity)

    def release(self) -> None:
        """Idle (nothing live): a growable pool gives its memory back (the engine asks
        at a weight update, not whenever the batch drains: reallocating costs more than
        a decode step on the CPU)."""
        if self.growable and not self.rows and self.slots:
            self._use(None)
            self.slots = self.capacity = 0

    # -- rows ---------------------------------------------------------------------------
    def add(self, owner: object, length: int) -> int:
        """A new live row whose first ``length`` columns the caller fills; its slot."""
        self.ensure(self.live + 1, length)
        self.rows.append(owner)
        self.length.append(length)
        return self.live - 1

    def remove(self, slot: int) -> object | None:
        """Free ``slot``: the last row moves into it (one copy of its filled columns).
        Returns the moved row's owner (None when ``slot`` was the last)."""
        last = self.live - 1
        moved = None
        if slot != last:
            n = self.length[last]
            self.kv[:, :, slot, :, :n] = self.kv[:, :, last, :, :n]
            self.rows[slot], self.length[slot] = self.rows[last], n
            moved = self.rows[slot]
        self.rows.pop()
        self.length.pop()
        return moved

    def clear(self) -> None:
        self.rows.clear()
        self.length.clear()

    # -- contents -----------------------------------------------------------------------
    def put(self, slot: int, kv: torch.Tensor) -> None:
        """Write ``kv`` ``(layers, 2, kv_heads, n, head_dim)`` at columns ``0 .. n-1``."""
        self.kv[:, :, slot, :, :kv.shape[3]] = kv

    def copy(self, src: int, dst: int, n: int) -> None:
        """Columns ``0 .. n-1`` of slot ``src`` into slot ``dst``."""
        self.kv[:, :, dst, :, :n] = self.kv[:, :, src, :, :n]

    def copy_from(self, other: "KVPool", src: int, dst: int, n: int, count: int = 1) -> None:
        """Columns ``0 .. n-1`` of ``other``'s slot ``src`` into this pool's slots ``dst ..
        dst + count - 1`` (a group's requests joining from one prompt), in one copy."""
        self.kv[:, :, dst:dst + count, :, :n] = other.kv[:, :, src:src + 1, :, :n]

    def kv_of(self, slot: int, a: int, b: int) -> torch.Tensor:
        """Columns ``a .. b-1`` of ``slot``: ``(layers, 2, kv_heads, b - a, head_dim)``, a
        view into the pool (copy it to keep it)."""
        return self.kv[:, :, slot, :, a:b]


def _doubled(size: int, need: int, least: int) -> int:
    """``size`` doubled (from at least ``least``) until it holds ``need``."""
    size = max(size, least)
    while size < need:
        size *= 2
    return size
