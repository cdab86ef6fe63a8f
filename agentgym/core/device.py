"""Where models live: the one module that names a device.

Every place that loads or moves a model (the policy, the KL reference, PPO's critic, the
rollout engine's copy, Ray rollout workers, ``agentgym serve``, ``agentgym eval``) asks
:func:`resolve_device` for its device, with ``trainer.device``:

- ``auto`` (the default): the process's CUDA device when torch sees one (a rank's
  ``LOCAL_RANK``, a Ray worker's first visible GPU), else the CPU;
- ``cpu``; ``cuda`` (the process's CUDA device, an error when there is none); ``cuda:N``.

The same place picks what goes with the device: bf16 weights for the rollout copy and bf16
autocast for the update on CUDA when the config leaves them open (:func:`engine_dtype`,
:func:`mixed_precision`), and the attention kernel (:func:`attn_implementation`: flash
attention 2 where the ``flash_attn`` package is installed, else PyTorch's SDPA). A test
(``tests/test_device.py``) walks the code and fails on a device named anywhere else.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from pathlib import Path

from agentgym.core.choices import MIXED_PRECISIONS

logger = logging.getLogger(__name__)

#: where tensors go to be collated, saved, sent between processes or offloaded
HOST = "cpu"
#: a GPU, where only the kind of device matters (the memory planner's GPU column)
ACCELERATOR = "cuda"
#: ``trainer.device`` values
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")

_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False without torch's CUDA build)."""
    import torch
    return torch.cuda.is_available()


def check_device(spec: str) -> str:
    """``spec`` if it is a valid ``trainer.device``; else a ValueError naming the valid ones."""
    if not isinstance(spec, str) or not _SPEC.fullmatch(spec):
        raise ValueError(f"trainer.device={spec!r}; valid: {' | '.join(DEVICE_CHOICES)}")
    return spec


def names_host(spec: str) -> bool:
    """Whether ``trainer.device=spec`` names the host (the CPU) rather than an accelerator;
    ``auto`` counts as an accelerator (a plan is for the machine the run is meant for)."""
    return check_device(spec) == "cpu"


def resolve_device(spec: str = "auto", local_rank: int | None = None):
    """The ``torch.device`` that ``trainer.device=spec`` names in this process.

    Args:
        spec: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``.
        local_rank: a rank process's index on its machine: ``auto`` and ``cuda`` then mean
            ``cuda:<local_rank>`` (default: ``LOCAL_RANK`` when set, else 0), and that device
            becomes the process's current CUDA device.

    Raises:
        ValueError: ``spec`` is not one of the above, names CUDA on a machine without it, or
            names a CUDA index this machine does not have.
    """
    import torch
    check_device(spec)
    if spec == HOST or (spec == "auto" and not cuda_available()):
        return torch.device(HOST)
    if not cuda_available():
        raise ValueError(f"trainer.device={spec!r} but torch sees no CUDA device here (torch "
                         f"{torch.__version__}); use trainer.device=auto or cpu")
    if spec.startswith("cuda:"):
        index = int(spec.split(":")[1])
    else:
        index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"trainer.device={spec!r} resolves to cuda:{index}, but this machine "
                         f"has {count} CUDA device(s): cuda:0 .. cuda:{count - 1}")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run_device(cfg):
    """The device a run's config names (``cfg.trainer.device`` resolved in this process):
    the one place a run's model loads, engine, memory plan and precision ask. A rank process
    resolves its own with its local index (``trainers.backends.ranks.device_for``)."""
    return resolve_device(cfg.trainer.device)


#: the x86 flags of a CPU that computes bf16 matrix products natively
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags() -> tuple[str, ...] | None:
    """Which of :data:`NATIVE_BF16_FLAGS` this CPU has (``()``: bf16 is emulated), or None
    where ``/proc/cpuinfo`` gives no flags (not Linux, or not x86): unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags") and ":" in ln), None)
    if line is None:
        return None
    have = set(line.split(":", 1)[1].split())
    return tuple(f for f in NATIVE_BF16_FLAGS if f in have)


_WARNED_BF16: set[str] = set()


def _check_cpu_bf16(key: str, device) -> None:
    """A WARNING, once per key and process, when ``key`` puts bf16 on a CPU that emulates
    it: there its matrix products are 20-60x slower than fp32 (``bench/cpu_matmul.py`` on a
    2-core AVX2 EPYC: 1-2 GFLOP/s against 35-63), so a run looks hung."""
    if is_accelerator(device) or cpu_bf16_flags() != () or key in _WARNED_BF16:
        return
    _WARNED_BF16.add(key)
    logger.warning("%s is bf16 on a CPU without native bf16 (none of %s in /proc/cpuinfo): "
                   "its matrix products are emulated here, 20-60x slower than fp32 "
                   "(bench/cpu_matmul.py); leave it unset for fp32", key,
                   ", ".join(NATIVE_BF16_FLAGS))


def is_accelerator(device) -> bool:
    """Whether ``device`` (a ``torch.device`` or string) is a GPU."""
    return str(device).startswith("cuda")


def has_fused_adamw(device) -> bool:
    """Whether torch's fused AdamW runs on ``device`` (CUDA and the CPU)."""
    return device.type in (HOST, ACCELERATOR)


def engine_dtype(configured: str, model_dtype: str, device) -> str:
    """The rollout copy's weights: ``engine.dtype`` when set; else bf16 on a GPU (the
    engine's kernels are bf16 there) and ``model.dtype`` on the CPU."""
    dtype = configured or ("bfloat16" if is_accelerator(device) else model_dtype)
    if dtype == "bfloat16":
        _check_cpu_bf16("engine.dtype" if configured else "model.dtype", device)
    return dtype


def mixed_precision(configured: str, device) -> str:
    """The update's autocast: ``trainer.mixed_precision`` ``bf16`` or ``fp32`` as set; ``""``
    (the default) is bf16 autocast over fp32 master weights on a GPU, fp32 on the CPU."""
    if configured not in MIXED_PRECISIONS:
        raise ValueError(f"trainer.mixed_precision={configured!r}; valid: '' (bf16 on GPU, "
                         f"fp32 on CPU), bf16, fp32")
    if configured == "fp32":
        return ""
    if configured == "bf16":
        _check_cpu_bf16("trainer.mixed_precision", device)
    return configured or ("bf16" if is_accelerator(device) else "")


def attn_implementation(device, dtype: str) -> str | None:
    """The attention kernel ``from_pretrained`` gets: ``flash_attention_2`` on a GPU with
    half-precision weights when ``flash_attn`` is installed, ``sdpa`` elsewhere on a GPU,
    and transformers' own default (None) on the CPU."""
    if not is_accelerator(device):
        return None
    if dtype in ("bfloat16", "float16") and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def peak_memory_gb(device) -> float | None:
    """The most memory torch has held on a GPU ``device`` since the last call, in GiB, and
    a fresh start for the next; None on the CPU (the process RSS is the CPU's figure)."""
    if not is_accelerator(device):
        return None
    import torch
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def total_memory_bytes(device) -> int:
    """The whole memory of ``device``: a GPU's, or the host's (what the memory planner sizes
    a run's micro-batches against: agentgym.models.plan.micro_batch_tokens)."""
    if not is_accelerator(device):
        import psutil
        return psutil.virtual_memory().total
    import torch
    return torch.cuda.get_device_properties(device).total_memory


# -- what the rollout engine asks of a GPU (agentgym.rollout.engines) -----------------------
def free_memory_bytes(device) -> int:
    """Bytes free on ``device`` now (what a KV pool may be sized from): the GPU's free
    memory, or the host's available memory on the CPU."""
    if not is_accelerator(device):
        import psutil
        return psutil.virtual_memory().available
    import torch
    free, _ = torch.cuda.mem_get_info(device)
    return free


def bind_thread(device) -> None:
    """Make ``device`` this thread's current CUDA device (a thread starts on device 0
    whatever its process chose: an engine on ``cuda:1`` steps on ``cuda:1``). Nothing
    on the CPU."""
    if is_accelerator(device):
        import torch
        torch.cuda.set_device(device)


def is_capturing(device) -> bool:
    """Whether a graph is being captured on ``device``'s current stream, or this thread
    records the CPU stand-in."""
    from agentgym.core.recorded_graph import recording  # lazy: loads torch
    if recording():
        return True
    if not is_accelerator(device):
        return False
    import torch
    return torch.cuda.is_current_stream_capturing()


def graph_pool(device):
    """A memory pool several CUDA graphs share (they replay one at a time); None for the
    stand-in."""
    if not is_accelerator(device):
        return None
    import torch
    return torch.cuda.graph_pool_handle()


def capture_graph(step, pool, device, warmup: int = 2):
    """``step()`` captured as a graph in ``pool``, after ``warmup`` eager runs (on a GPU on
    a side stream: the allocator and the kernels' choices settle outside the capture).
    Returns the graph; ``graph.replay()`` runs it again over the same tensors.

    On a GPU a ``torch.cuda.CUDAGraph`` captured with ``capture_error_mode="thread_local"``
    (another thread's CUDA calls, the async trainer's, neither break nor are broken by the
    capture); elsewhere the stand-in
    :class:`~agentgym.core.recorded_graph.RecordedGraph`, after the same warm-ups.
    """
    if not is_accelerator(device):
        from agentgym.core.recorded_graph import RecordedGraph  # lazy: loads torch
        for _ in range(warmup):
            step()
        graph = RecordedGraph()
        graph.record(step)
        return graph
    import torch
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        step()
    return graph


def to_host_async(tensor):
    """``(host tensor, event)``: on a GPU an asynchronous copy into pinned memory and the
    CUDA event that marks its end (``event.synchronize()`` before reading); on the CPU the
    tensor itself and None."""
    if not is_accelerator(tensor.device):
        return tensor, None
    import torch
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
