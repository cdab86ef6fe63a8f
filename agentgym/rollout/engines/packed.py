"""The CPU's linear layers over weight copies in oneDNN's blocked layout.

PyTorch's CPU ``linear`` hands the BLAS the row-major weight on every call, and at a
decode step's few rows (one per request) the BLAS spends most of its time reading the
weight in an order its kernel cannot stream. oneDNN's ``_reorder_linear_weight`` copies a
weight once into the blocked layout its kernel reads, and ``_linear_pointwise`` multiplies
against that copy: on this project's 2-core machine, smollm2-135m's head (49,152 x 576)
at 16 rows takes 8.0 ms instead of 27.8 in fp32 and a decoder layer's seven projections
0.75 ms instead of 1.47 (bf16: 3.4 against 7.6 ms, 0.45 against 0.57; docs/DECISIONS.md
"Packed weights on the CPU"). PyTorch's own compiler does the same when it freezes a
model (``torch._inductor.config.freezing``), but a frozen model cannot take new weights.

The copies follow the parameters: :meth:`PackedWeights.refresh` (called before each
forward) packs again any weight whose storage or version counter moved, so
``load_state_dict`` (what ``HFEngine.update_weights`` does) and any other in-place write
are seen by the next step. A write through ``.data`` does not move the version counter;
:meth:`PackedWeights.clear` drops every copy for that case.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: why packing is off on this build (None: not probed yet; "": it works)
_WHY_NOT: dict[torch.dtype, str] = {}


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
    """Blocked copies of ``linears``' weights (``torch.nn.Linear`` only: an adapter-wrapped
    layer, LoRA's, runs its own forward), and the linear over them."""

    def __init__(self, linears) -> None:
        seen: dict[int, torch.nn.Linear] = {}
        for m in linears:  # an inference tensor has no version counter to follow: unpacked
            if type(m) is torch.nn.Linear and _version(m.weight) is not None:
                seen.setdefault(id(m), m)
        self.linears = list(seen.values())
        #: module -> (the weight packed, its version then, the packed copy)
        self._packed: dict[torch.nn.Linear, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.packs = 0  # copies made so far (the tests read when a weight was packed again)

    def refresh(self) -> int:
        """Pack every weight not packed yet or changed since; returns how many."""
        n = 0
        for m in self.linears:
            w, entry = m.weight, self._packed.get(m)
            version = _version(w)
            if entry is None or entry[0] is not w or entry[1] != version:
                with torch.inference_mode():
                    self._packed[m] = (w, version, _pack(w))
                n += 1
        self.packs += n
        return n

    def clear(self) -> None:
        self._packed.clear()

    def __call__(self, module, x: torch.Tensor) -> torch.Tensor:
        entry = self._packed.get(module)
        if entry is None:
            return module(x)
        return _linear(x, entry[2], module.bias)


def _version(w: torch.Tensor) -> int | None:
    """``w``'s version counter (None for an inference tensor, which has none)."""
    try:
        return w._version
    except RuntimeError:
        return None
