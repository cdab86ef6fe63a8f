"""The CPU's linear layers over weight copies in oneDNN's blocked layout.

PyTorch's CPU ``linear`` hands the BLAS the row-major weight on every call, and at a
decode step's few rows (one per request) it is far from the machine's limits: on this
project's 2-core machine smollm2-135m's head (49,152 x 576) at 16 rows in fp32 reads its
weight at 5 GB/s and multiplies at 39 GFLOPS, where the machine reads 28 GB/s and a large
product runs at 176 GFLOPS. oneDNN's ``_reorder_linear_weight`` copies a weight once into
the blocked layout its kernel reads, and ``_linear_pointwise`` multiplies against that
copy: the same head takes 8.0 ms instead of 27.8, and a decoder layer's seven projections
0.75 ms instead of 1.47 (bf16: 3.4 against 7.6 ms, 0.45 against 0.57;
docs/decisions/engine.md, "Packed weights on the CPU"). PyTorch's own compiler does the same
when it freezes a model (``torch._inductor.config.freezing``), but a frozen model cannot take
new weights.

The copies follow the parameters: :meth:`PackedWeights.refresh` (called before each
forward) packs again any group one of whose weights or biases was replaced, moved to
other storage or written in place (its version counter), so ``load_state_dict`` (what
``HFEngine.update_weights`` does) and any other in-place write are seen by the next step.
An in-place write through ``.data`` moves neither; :meth:`PackedWeights.clear` drops
every copy for that case.

Below :data:`BLOCKED_MIN` weight elements oneDNN's call costs more than the product it
saves (some 30 us a call on this machine, where ``F.linear`` of a 64 -> 64 layer at 64
rows takes 10): a group that small is stacked into a plain copy (one ``F.linear`` for
q/k/v or gate/up), and a single linear that small runs its own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: dtype -> why packing is off on this build ("": it works), once probed
_WHY_NOT: dict[torch.dtype, str] = {}
#: the fewest weight elements (a group's stacked rows x its input width) given a blocked
#: copy: oneDNN's product is slower below it (2-core EPYC, fp32, 16 and 64 rows: 256 -> 768
#: 0.84x and 0.98x of ``F.linear``'s speed, 384 -> 1152 1.15x and 1.00x, the 64 -> 1024
#: head 0.89x and 1.09x; docs/decisions/engine.md, "Packed weights on the CPU")
BLOCKED_MIN = 1 << 18


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def why_not_packed(dtype: torch.dtype) -> str:
    """Why this build cannot run packed linears in ``dtype`` ("" : it can): probed once
    per dtype against ``F.linear`` on a small random layer."""
    if dtype not in _WHY_NOT:
        _WHY_NOT[dtype] = _probe(dtype)
    return _WHY_NOT[dtype]


def _probe(dtype: torch.dtype) -> str:
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 5, 40, generator=g).to(dtype)
        with torch.inference_mode():
            got, want = _linear(x, _pack(w), b).float(), F.linear(x, w, b).float()
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"oneDNN's packed linear failed here ({type(e).__name__}: {e})"
    tol = 1e-4 if dtype == torch.float32 else 0.1
    if got.shape != want.shape or not torch.allclose(got, want, atol=tol, rtol=tol):
        return "oneDNN's packed linear disagrees with torch's linear on this build"
    return ""


class PackedWeights:
    """Blocked copies of the weights of groups of linears that read the same input (a
    layer's q/k/v projections, its MLP's gate and up: one copy of their rows stacked,
    one product, split after, as vLLM's ``QKVParallelLinear`` does), and the linear over
    them; a group under ``blocked_min`` weight elements gets a plain stacked copy, a
    single linear that small none. ``torch.nn.Linear`` only: an adapter-wrapped layer
    (LoRA's) runs its own forward, and a group with one runs every member's own."""

    def __init__(self, groups, blocked_min: int = BLOCKED_MIN) -> None:
        self.blocked_min = blocked_min
        self.groups: list[tuple[torch.nn.Linear, ...]] = []
        for group in groups:
            group = tuple(group)
            if (all(_packable(m) for m in group) and len({m.in_features for m in group}) == 1
                    and (len(group) > 1 or self._blocked(group))):
                self.groups.append(group)
        self.linears = [m for g in self.groups for m in g]
        #: the linears whose copy is blocked (the rest of :attr:`linears`: stacked, plain)
        self.blocked = [m for g in self.groups if self._blocked(g) for m in g]
        #: group -> (its _key when copied, the copy, the bias, each member's rows, blocked)
        self._packed: dict[tuple, tuple] = {}
        self.packs = 0  # weights copied so far (the tests read when one was copied again)

    def refresh(self) -> int:
        """Pack every group not packed yet or with a weight changed since; returns how
        many weights were packed."""
        n = 0
        for group in self.groups:
            key = _key(group)
            entry = self._packed.get(group)
            if entry is None or entry[0] != key:
                with torch.inference_mode():
                    self._packed[group] = (key, *_stacked(group, self._blocked(group)))
                n += len(group)
        self.packs += n
        return n

    def clear(self) -> None:
        self._packed.clear()

    def __call__(self, group: tuple, x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``group``'s linears of ``x``."""
        entry = self._packed.get(group)
        if entry is None:
            return [m(x) for m in group]
        y = _product(entry, x)
        return [y] if len(group) == 1 else list(y.split(entry[3], dim=-1))

    def product(self, group: tuple, x: torch.Tensor) -> torch.Tensor | None:
        """``group``'s linears of ``x`` as one tensor, their outputs side by side in the
        group's order (None: the group has no copy, its members run their own)."""
        entry = self._packed.get(group)
        return None if entry is None else _product(entry, x)

    def _blocked(self, group: tuple) -> bool:
        """Whether ``group``'s copy is oneDNN-blocked (else plain, stacked)."""
        return _elements(group) >= self.blocked_min


def _product(entry: tuple, x: torch.Tensor) -> torch.Tensor:
    return (_linear if entry[4] else F.linear)(x, entry[1], entry[2])


def _key(group: tuple) -> tuple:
    """What a packed copy was made from: each weight's and bias's identity, storage and
    version (``load_state_dict`` moves a version; ``.data = ...`` moves a storage)."""
    return tuple((id(t), t.data_ptr(), _version(t)) for m in group
                 for t in (m.weight, m.bias) if t is not None)


def _packable(m) -> bool:
    # an inference tensor has no version counter to follow: not packed
    return type(m) is torch.nn.Linear and all(
        _version(t) is not None for t in (m.weight, m.bias) if t is not None)


def _elements(group: tuple) -> int:
    return sum(m.weight.numel() for m in group)


def _stacked(group: tuple, blocked: bool) -> tuple:
    """The copy of ``group``'s weights stacked by rows (oneDNN-blocked or plain), their
    biases (zeros for a member without one; None when none has), each
    member's rows, and whether the copy is blocked."""
    sizes = [m.out_features for m in group]
    weight = group[0].weight if len(group) == 1 else torch.cat([m.weight for m in group])
    bias = None
    if any(m.bias is not None for m in group):
        bias = torch.cat([m.bias.detach() if m.bias is not None else
                          m.weight.new_zeros(m.out_features) for m in group])
    return _pack(weight) if blocked else weight.detach(), bias, sizes, blocked


def _version(w: torch.Tensor) -> int | None:
    """``w``'s version counter (None for an inference tensor, which has none)."""
    try:
        return w._version
    except RuntimeError:
        return None
