"""A stand-in for ``torch.cuda.CUDAGraph`` that runs anywhere: the engine's captured path
under test on the CPU.

A CUDA graph is a recording of kernels over fixed addresses: replay runs the same kernels,
with the same shapes and the same Python decisions, on whatever the captured tensors hold
now; tensors made during capture keep their addresses, so a reader of the captured output
sees each replay's result; a tensor swapped for another after capture is not seen; a host
sync during capture is an error. :class:`RecordedGraph` keeps those properties without a
GPU: while it records, a ``TorchDispatchMode`` logs every ATen call with its arguments
(the very tensor objects); :meth:`RecordedGraph.replay` calls them again in order and
copies each fresh result into the tensor the recording produced (an op that returns a
view or writes in place already acts on the captured storage). Python between the ops,
a forward hook, a branch on a flag, a stats counter, runs only while recording, as on a
GPU.

One difference is on the strict side: recording executes the step (a CUDA capture only
enqueues it), so a recording has the side effects of one more warm-up run; a step whose
warm-ups are harmless is harmless here too, and one whose warm-ups are not is caught.

It is not fast: each replay dispatches every op again from Python. It exists so that the
default tier executes capture, bucket padding, static buffers and replay
(:func:`agentgym.core.device.capture_graph` gives it off a GPU when asked).
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_local = threading.local()

#: ops that read a device tensor's value on the host: a CUDA capture refuses them
_HOST_SYNCS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero",
               "aten::equal", "aten::nonzero", "aten::masked_select", "aten::unique")


def recording() -> bool:
    """Whether this thread is recording a :class:`RecordedGraph` (as
    ``torch.cuda.is_current_stream_capturing`` is on a GPU)."""
    return getattr(_local, "recording", False)


class HostSyncInCapture(RuntimeError):
    """A captured step read a tensor's value on the host (CUDA: "operation not permitted
    when stream is capturing")."""


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _HOST_SYNCS:
            raise HostSyncInCapture(
                f"{name} inside a captured step: a CUDA graph cannot read a tensor's value "
                "on the host while it captures (keep the step free of .item(), .tolist(), "
                "boolean indexing and data-dependent shapes)")
        out = func(*args, **kwargs)
        # a result in new memory is refreshed in place on replay; a view or an in-place
        # result already is the captured storage. Told by the memory, not the schema:
        # reshape, to and contiguous may alias or copy (the shapes decide, and a replay
        # sees the same shapes)
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        fresh = [t if _storage(t) not in inputs else None
                 for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.ops.append((func, args, kwargs, fresh if any(t is not None for t in fresh)
                         else []))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class RecordedGraph:
    """A step recorded once and replayed over the same tensors (see the module)."""

    def __init__(self) -> None:
        self.ops: list = []

    def record(self, step) -> None:
        """Run ``step()`` once, logging its ops."""
        _local.recording = True
        try:
            with _Recorder(self.ops):
                step()
        finally:
            _local.recording = False

    def replay(self) -> None:
        for func, args, kwargs, fresh in self.ops:
            out = func(*args, **kwargs)
            if fresh:
                new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                for old, value in zip(fresh, new):
                    if old is not None:
                        old.copy_(value)
