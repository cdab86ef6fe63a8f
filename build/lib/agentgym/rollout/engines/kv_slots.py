"""Keys and values of a continuously batched decode: rows come and go, no drain.

Rows (slots) share one buffer per layer, ``(slots, kv_heads, columns, head_dim)``, and are
right-aligned at a shared write column ``end``: row ``i`` holds its positions in columns
``start[i] .. end - 1`` and everything left of ``start[i]`` is masked out. A decode step
writes every row's new token at column ``end`` and then advances it. A new row of length
``T`` goes into a free slot at columns ``end - T .. end - 1``; a finished row only frees its
slot (no copy). The buffers are laid out again (one copy of the live rows) only when a
new row is longer than ``end``, the columns or slots run out, or too much of the buffer
is dead (freed slots or masked columns on the left).

Positions are explicit (``end - start[i]`` for the new token), so a row's alignment never
moves its rotary positions; the attention mask hides other rows' columns.

:func:`buffered_cache` is the single-sequence (or static-batch) counterpart: a
``DynamicCache`` whose layers write into a pre-allocated buffer instead of concatenating.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's view of the slot buffers; :class:`Slots` owns the layout."""

    def __init__(self, owner: "Slots", index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        o = self.owner
        k, v = o.k[self.index], o.v[self.index]
        n = key_states.shape[-2]
        k[:o.used, :, o.end:o.end + n] = key_states
        v[:o.used, :, o.end:o.end + n] = value_states
        self.keys, self.values = k[:o.used, :, :o.end + n], v[:o.used, :, :o.end + n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.end

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.end + query_length, 0


class Slots:
    """The decode batch: ``rows[i]`` is the caller's object for slot ``i`` (None: free)."""

    #: columns kept free on the left after a layout, so slightly longer newcomers fit
    HEADROOM = 64

    def __init__(self, n_layers: int, config, max_rows: int) -> None:
        self.n_layers, self.max_rows = n_layers, max_rows
        self.cache = DynamicCache(config=config)
        self.cache.layers = [SlotLayer(self, i) for i in range(n_layers)]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows: list[object | None] = []
        self.start: list[int] = []
        self.used = 0  # slots 0 .. used-1 take part in a decode step (free ones too)
        self.end = 0
        self.layouts = 0  # how many times the live rows were copied to a new layout
        self._heads: list[tuple[int, int]] = []  # per layer (kv_heads, head_dim)
        self._dtype, self._device = torch.float32, None  # the first row sets them

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows[:self.used])

    def length(self, slot: int) -> int:
        """Positions of ``slot`` in the cache."""
        return self.end - self.start[slot]

    def add(self, kv: list[tuple[torch.Tensor, torch.Tensor]], row: object,
            room: int) -> int:
        """Put a row whose keys/values are ``kv`` (per layer, each ``(kv_heads, T,
        head_dim)``) into a free slot; ``room``: decode steps it may still take."""
        t = kv[0][0].shape[1]
        if not self._heads:  # the first row gives the layers' shapes, dtype and device
            self._heads = [(k.shape[0], k.shape[2]) for k, _ in kv]
            self._dtype, self._device = kv[0][0].dtype, kv[0][0].device
        free = next((i for i in range(self.used) if self.rows[i] is None), None)
        need_rows = self.used + (free is None)
        if (not self.k or t > self.end or need_rows > self.k[0].shape[0]
                or self.end + room > self.k[0].shape[2]):
            self._layout(extra_rows=1, min_end=t, room=room)
            free = None
        slot = free if free is not None else self.used
        if slot == self.used:
            self.used += 1
            self.rows.append(None)
            self.start.append(self.end)
        a = self.end - t
        for layer, (k, v) in enumerate(kv):
            self.k[layer][slot, :, a:self.end] = k
            self.v[layer][slot, :, a:self.end] = v
        self.rows[slot], self.start[slot] = row, a
        return slot

    def free(self, slot: int) -> None:
        self.rows[slot] = None
        while self.used and self.rows[self.used - 1] is None:
            self.used -= 1
            self.rows.pop()
            self.start.pop()
        if not self.used:
            self.k, self.v, self.end = [], [], 0  # idle: give the memory back

    def kv_of(self, slot: int, a: int, b: int) -> torch.Tensor:
        """Positions ``a .. b-1`` of ``slot``: ``(layers, 2, kv_heads, b - a, head_dim)``."""
        s = self.start[slot]
        return torch.stack([torch.stack((self.k[i][slot, :, s + a:s + b],
                                         self.v[i][slot, :, s + a:s + b]))
                            for i in range(self.n_layers)])

    def step_inputs(self, room: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask ``(used, end + 1)`` and positions ``(used, 1)`` for the next
        decode step (lays the buffers out again first if that is due)."""
        if self.end + 1 > self.k[0].shape[2] or self._wasteful():
            self._layout(extra_rows=0, min_end=0, room=room)
        device = self.k[0].device
        start = torch.tensor(self.start[:self.used], device=device)
        cols = torch.arange(self.end + 1, device=device)
        mask = (cols[None, :] >= start[:, None]).long()
        return mask, (self.end - start)[:, None]

    def advance(self) -> None:
        self.end += 1

    # -- layout -------------------------------------------------------------------------
    def _wasteful(self) -> bool:
        live = self.live
        longest = max((self.length(i) for i in range(self.used) if self.rows[i] is not None),
                      default=0)
        dead_rows = self.used - live > max(4, live)
        dead_cols = self.end - longest > max(2 * self.HEADROOM, longest)
        return dead_rows or dead_cols

    def _layout(self, extra_rows: int, min_end: int, room: int) -> None:
        """Copy the live rows to slots ``0..`` of new buffers, right-aligned at a new
        ``end`` that fits the longest of them and ``min_end`` (plus headroom)."""
        self.layouts += 1
        keep = [i for i in range(self.used) if self.rows[i] is not None]
        longest = max([self.length(i) for i in keep] + [min_end])
        end = longest + self.HEADROOM
        n_rows = min(self.max_rows, max(4, 2 * (len(keep) + extra_rows)))
        cols = end + max(room, 64) + 64
        new_k, new_v = [], []
        for layer, (h, d) in enumerate(self._heads):
            shape = (n_rows, h, cols, d)
            k = torch.zeros(shape, dtype=self._dtype, device=self._device)
            v = torch.zeros(shape, dtype=self._dtype, device=self._device)
            for j, i in enumerate(keep):
                n = self.length(i)
                k[j, :, end - n:end] = self.k[layer][i, :, self.end - n:self.end]
                v[j, :, end - n:end] = self.v[layer][i, :, self.end - n:self.end]
            new_k.append(k)
            new_v.append(v)
        lengths = [self.length(i) for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.start = [end - n for n in lengths]
        self.k, self.v, self.used, self.end = new_k, new_v, len(keep), end


class BufferLayer(DynamicLayer):
    """A KV-cache layer that writes into a pre-allocated buffer.

    transformers' DynamicLayer concatenates the whole cache at every decode step, which
    on CPU costs more than the attention itself for batches of long prompts; this layer
    writes only the new positions and returns views of the filled part.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            cap = max(end, self.capacity, 2 * (0 if self._k is None else self._k.shape[-2]))
            k = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if self._k is not None:
                k[:, :, :self.length] = self._k[:, :, :self.length]
                v[:, :, :self.length] = self._v[:, :, :self.length]
            self._k, self._v = k, v
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


def buffered_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache whose full-attention layers are :class:`BufferLayer`s."""
    cache = DynamicCache(config=model.config.get_text_config())
    cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
