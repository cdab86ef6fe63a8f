"""The memory planner: what one device holds during a training step, from a model's shape
and the run's settings, and the cheapest change that makes a run fit (``agentgym plan``).

Per device: the policy's parameters, gradients and AdamW state (fp32 master weights, as
the trainer keeps them; sharded by FSDP or ZeRO, or on the host with offload), the
activations of one micro-batch (``trainer.micro_batch_tokens``; with activation
checkpointing only each layer's input is kept, plus one layer recomputed), the log-prob
pass's fp32 logits (``trainer.logprob_chunk`` positions at a time, else all), the reference
model (bf16, when a KL term needs it), the critic (PPO: a second model with its own state
and activations), and the in-process rollout engine's weights and KV cache (bf16 on a GPU;
on the CPU in the engine's dtype, with the packed copies of ``engine.packed_weights``).

The constants that no shape determines (bytes per saved activation element, copies of
the logits, the process's own footprint) were fitted to measured peaks: on the CPU to
``bench/update_memory.py``'s nine cells (docs/BENCHMARKS.md, "Memory planner"); on a GPU
the bytes per activation element to ``bench/update_speed.py``'s step peaks on an H200
(docs/GPU.md), the CUDA context not measured.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from agentgym.core.choices import SHARDED_BACKENDS
from agentgym.core.device import (ACCELERATOR, HOST, engine_dtype, is_accelerator, run_device,
                                  total_memory_bytes)
from agentgym.models.shapes import shape_config, shape_names
from agentgym.models.zoo import MODEL_NAMES, resolve_model

GiB = 2 ** 30
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Device:
    """The constants of one device kind: ``base`` (bytes the process holds before any
    tensor: the CPU's Python and torch, a GPU's CUDA context and workspaces),
    ``act_bytes`` (bytes per saved activation element), ``ckpt_bytes`` (per element of a
    checkpointed layer input), ``logit_copies`` (fp32 logits, log-softmax and their
    gradients held at once)."""

    name: str
    base: float
    act_bytes: float
    ckpt_bytes: float
    logit_copies: float


#: host (the CPU): fitted to bench/update_memory.py (smollm2-135m, bf16 autocast, 1k and 8k tokens;
#: the 4k cells held out). GPU: ``act_bytes`` from bench/update_speed.py's step peaks on an
#: H200 (nine packed cells, smollm2-135m and qwen2.5-1.5b, 3.5k-37k tokens a micro-batch,
#: bf16 autocast: 2.5-3.7 bytes per element; at 3.0 the total is -4% to +24% of torch's
#: allocated peak, tests/test_plan.py's MEASURED_GPU; docs/GPU.md); the 1.5 GiB CUDA
#: context is not measured (torch's allocator does not count it).
DEVICES = {"host": Device("host", 0.3 * GiB, 3.3, 2.0, 4.0),
           "gpu": Device("gpu", 1.5 * GiB, 3.0, 2.0, 4.0)}

#: ``trainer.micro_batch_tokens=0`` (auto): the CPU's budget (measured best there:
#: docs/BENCHMARKS.md, "Policy update speed"), and a GPU's candidates, largest first, of
#: which the first the planner fits in :data:`AUTO_FIT` of the device is taken. On a GPU
#: the update is bound by kernel launches below about 16k tokens a micro-batch (an H200:
#: qwen2.5-1.5b 23.9-33.8% MFU at 4,096, 39.3-39.8% at 16,384; docs/GPU.md)
AUTO_HOST_TOKENS = 4096
AUTO_GPU_TOKENS = (65536, 32768, 16384, 8192, 4096)
AUTO_FIT = 0.8


#: (chunk, vocab) fp32 temporaries of the fused head beside what it keeps: one chunk's
#: logits turned log-softmax in place, and its exp
PACKED_CHUNK_COPIES = 2
#: the most log-softmax bytes the fused head keeps for its backward
#: (``agentgym.trainers.fused_head.KEEP_BYTES``, which reads it from here)
HEAD_KEEP_BYTES = 2 << 30


@dataclass(frozen=True)
class Setting:
    """What the run does, as the planner needs it (built from a config by the CLI)."""

    device: str = "gpu"  # a key of DEVICES: host (the CPU) | gpu
    gpus: int = 1  # devices the update is spread over (trainer.nprocs)
    backend: str = "single"  # single | fsdp | deepspeed
    zero_stage: int = 2
    offload: bool = False  # parameters (FSDP) or optimizer state (ZeRO) on the host
    checkpointing: bool = False
    micro_batch_tokens: int = 4096
    logprob_chunk: int = 1024
    packing: bool = True  # trainer.packing: the fused head keeps its log-softmax
    lora_rank: int = 0
    reference: bool = False  # a KL term against a frozen copy
    ref_offload: bool = False
    #: on-policy distillation's teachers held on this device (trainer.teacher; an
    #: endpoint's is not): their parameters, at teacher_bytes each
    teacher_params: int = 0
    teacher_bytes: int = 4
    teacher_offload: bool = False  # algo.teacher_offload: in host memory
    critic: bool = False  # a value model of the same shape (cfg.algo.needs_critic: gae, gae_turn)
    engine: bool = True  # the in-process rollout engine's copy on this device
    engine_dtype: str = "bfloat16"  # its weights and KV cache (float32 | bfloat16)
    engine_packed: bool = False  # a second copy of its weights (the CPU's packed linears)
    concurrency: int = 0  # episodes in flight (rollout.max_concurrency)
    episode_tokens: int = 0  # an episode's tokens at most (prompt + response budgets)

    @property
    def kv_tokens(self) -> int:
        """Tokens the engine's KV cache holds when every episode in flight is at its
        longest: the worst case, which a run reaches when its answers run long."""
        return self.concurrency * self.episode_tokens


@dataclass(frozen=True)
class Shape:
    """The numbers of an architecture the planner uses."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # key/value heads x head dim
    vocab: int

    @property
    def act_elements(self) -> int:
        """Saved elements per token per layer without checkpointing: norms, q/k/v, the
        attention output and projection, the residuals (6 x hidden + 2 x kv), and the
        gated MLP's gate, up, product and down input (4 x intermediate)."""
        return 6 * self.hidden + 2 * self.kv_dim + 4 * self.intermediate


def shape_numbers(config: dict[str, Any]) -> Shape:
    """A :class:`Shape` from a ``config.json`` (a vision-language one: its language model
    for the layers, and every parameter counted), parameters counted on the meta device."""
    text = {**config, **config["text_config"]} if "text_config" in config else config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return Shape(params=count_parameters(config), layers=text["num_hidden_layers"],
                 hidden=text["hidden_size"], intermediate=text["intermediate_size"],
                 kv_dim=(text.get("num_key_value_heads") or heads) * head_dim,
                 vocab=text["vocab_size"])


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model ``config`` describes, built on the meta device (no memory)."""
    import torch
    import transformers
    values = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    auto = transformers.AutoConfig.for_model(config["model_type"], **values)
    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = cls(auto)
    return sum(p.numel() for p in model.parameters())


def breakdown(shape: Shape, s: Setting) -> list[tuple[str, float]]:
    """``(component, bytes)`` on one device, in the order a reader adds them up."""
    dev = DEVICES[s.device]
    shard = s.gpus if s.backend in SHARDED_BACKENDS else 1
    p = shape.params
    trained = p if not s.lora_rank else _lora_params(shape, s.lora_rank)
    # what each sharding splits: FSDP (and ZeRO-3) everything, ZeRO-2 grads + optimizer,
    # ZeRO-1 the optimizer; offload puts FSDP's parameters / ZeRO's optimizer on the host
    split = {"params": 1, "grads": 1, "optim": 1}
    if s.backend == "fsdp" or (s.backend == "deepspeed" and s.zero_stage == 3):
        split = {k: shard for k in split}
    elif s.backend == "deepspeed":
        split = {"params": 1, "grads": shard if s.zero_stage >= 2 else 1, "optim": shard}
    sharded = s.backend in SHARDED_BACKENDS  # offload is theirs (the config says so)
    host = {"params": s.offload and s.backend == "fsdp", "grads": s.offload and s.backend == "fsdp",
            "optim": s.offload and sharded}
    rows = [("process (runtime, libraries)", dev.base)]
    weights = 4 * p if not s.lora_rank else 2 * p + 4 * trained  # LoRA: a bf16 frozen base
    for name, size in (("params", weights), ("grads", 4 * trained), ("optim", 8 * trained)):
        label = {"params": "policy weights (fp32)", "grads": "gradients (fp32)",
                 "optim": "AdamW state (2 x fp32)"}[name]
        rows.append((label + (" [on the host]" if host[name] else ""),
                     0.0 if host[name] else size / split[name]))
    if split["params"] > 1 or host["params"]:  # one layer gathered whole while it computes
        rows.append(("gathered layer (weights and gradients)", 8 * p / shape.layers))
    rows.append(("activations (one micro-batch)", activations(shape, s, dev)))
    chunk = min(s.micro_batch_tokens, s.logprob_chunk or s.micro_batch_tokens)
    if s.packing:  # agentgym.trainers.fused_head: the kept log-softmax of the sampled
        # positions (at most every token of the micro-batch), and one chunk's temporaries
        kept = min(s.micro_batch_tokens * shape.vocab * 4, HEAD_KEEP_BYTES)
        rows.append(("log-prob head (kept log-softmax, fp32)",
                     kept + chunk * shape.vocab * 4 * PACKED_CHUNK_COPIES))
    else:
        rows.append(("log-prob logits (fp32)", chunk * shape.vocab * 4 * dev.logit_copies))
    if s.reference and not s.lora_rank:  # LoRA: the base model is the reference
        rows.append(("reference model (bf16)" + (" [on the host]" if s.ref_offload else ""),
                     0.0 if s.ref_offload else 2 * p / split["params"]))
    if s.teacher_params:  # placed as the reference is: FSDP shards it, ZeRO keeps it whole
        split_t = shard if s.backend == "fsdp" else 1
        rows.append((f"teacher model ({'fp32' if s.teacher_bytes == 4 else 'bf16'}, trainer."
                     f"teacher)" + (" [on the host]" if s.teacher_offload else ""),
                     0.0 if s.teacher_offload else s.teacher_bytes * s.teacher_params / split_t))
    if s.critic:  # sharded and offloaded as the policy is
        on_host = host["params"]
        rows.append(("critic: weights, gradients, AdamW" + (" [on the host]" if on_host else ""),
                     0.0 if on_host else 16 * p / split["optim"]))
        rows.append(("critic: activations", activations(shape, s, dev)))
    if s.engine:
        size, name = (4, "fp32") if s.engine_dtype == "float32" else (2, "bf16")
        rows.append((f"rollout engine weights ({name})", size * p))
        if s.engine_packed:  # every linear and the head: at most the weights again
            rows.append((f"rollout engine packed linears ({name}, engine.packed_weights)",
                         size * p))
        kv = s.kv_tokens * shape.layers * 2 * shape.kv_dim * size
        rows.append((f"rollout KV cache ({s.concurrency} x {s.episode_tokens} tokens, {name})",
                     kv))
    return rows


def activations(shape: Shape, s: Setting, dev: Device) -> float:
    t = s.micro_batch_tokens
    if s.checkpointing:  # each layer's input, and one layer's activations in the backward
        return t * shape.layers * shape.hidden * dev.ckpt_bytes + \
            t * shape.act_elements * dev.act_bytes
    return t * shape.layers * shape.act_elements * dev.act_bytes


def _lora_params(shape: Shape, rank: int) -> int:
    """Adapters on q, k, v, o and the three MLP projections of every layer."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    per_layer = rank * ((h + h) * 2 + (h + kv) * 2 + 2 * (h + i) + (i + h))
    return shape.layers * per_layer


#: the changes the planner weighs: (key, what it costs, the setting's change). A halving
#: may be taken several times, each costing its price again.
SWITCHES: list[tuple[str, float, dict[str, Any]]] = [
    ("trainer.logprob_chunk=1024", 0.0, {"logprob_chunk": 1024}),
    ("model.gradient_checkpointing=true", 1.0, {"checkpointing": True}),  # ~15% slower
    ("algo.ref_offload=true", 1.0, {"ref_offload": True}),
    ("trainer.backend=fsdp", 2.0, {"backend": "fsdp"}),
    ("trainer.offload=true", 3.0, {"offload": True}),  # host memory, PCIe traffic
]
HALVINGS: list[tuple[str, str, float, int, int]] = [
    # (key, Setting field, cost per halving, floor, most halvings)
    ("trainer.micro_batch_tokens", "micro_batch_tokens", 0.5, 256, 4),
    ("rollout.max_concurrency", "concurrency", 1.0, 1, 6),
]


def total(shape: Shape, s: Setting) -> float:
    return sum(b for _, b in breakdown(shape, s))


def auto_tokens(shape: Shape, s: Setting, capacity: float) -> int:
    """The micro-batch budget ``trainer.micro_batch_tokens=0`` means for ``s`` on a device of
    ``capacity`` bytes: :data:`AUTO_HOST_TOKENS` on the host; on a GPU the largest of
    :data:`AUTO_GPU_TOKENS` whose plan fits :data:`AUTO_FIT` of it (the smallest if none
    does: the plan's verdict then says what else to change)."""
    if s.device == "host":
        return AUTO_HOST_TOKENS
    for tokens in AUTO_GPU_TOKENS:
        if total(shape, dataclasses.replace(s, micro_batch_tokens=tokens)) <= AUTO_FIT * capacity:
            return tokens
    return AUTO_GPU_TOKENS[-1]


def cheapest_fit(shape: Shape, s: Setting, capacity: float) -> tuple[list[str], Setting] | None:
    """The cheapest combination of :data:`SWITCHES` and :data:`HALVINGS` that fits
    ``capacity`` bytes (prices: checkpointing and the reference's offload 1, each halving
    of the micro-batch 0.5 and of the episodes in flight 1, FSDP 2, offload 3; ties: fewer
    changes), as ``(the keys to set, the setting)``; None if none fits."""
    import itertools
    switches = [sw for sw in SWITCHES if not (sw[2].get("backend") and s.backend != "single")]
    best = None
    for picks in itertools.product((False, True), repeat=len(switches)):
        base, cost, keys = s, 0.0, []
        for on, (key, price, change) in zip(picks, switches):
            tried = dataclasses.replace(base, **change) if on else base
            if tried != base:
                base, cost, keys = tried, cost + price, keys + [key]
        for halves in itertools.product(*(range(n + 1) for *_, n in HALVINGS)):
            cur, c, k = base, cost, list(keys)
            for (key, field, price, floor, _), h in zip(HALVINGS, halves):
                value = max(floor, getattr(s, field) >> h)
                if value != getattr(cur, field):
                    cur = dataclasses.replace(cur, **{field: value})
                    c, k = c + price * h, k + [f"{key}={value}"]
            if cur != s and total(shape, cur) <= capacity and \
                    (best is None or (c, len(k)) < (best[0], len(best[1]))):
                best = (c, k, cur)
    return None if best is None else (best[1], best[2])


# --- from a run's config (duck-typed: this floor does not import agentgym.config) -------
def shape_of(model: str) -> tuple[str, dict[str, Any]]:
    """``(where from, config.json)`` of ``model.name``: a shipped shape, or the folder a zoo
    name or path resolves to (the zoo builds its own models first)."""
    import json

    if model in shape_names() and model not in MODEL_NAMES:  # the zoo builds its own
        return f"shape {model}", shape_config(model)
    folder = resolve_model(model)
    return str(folder), json.loads((folder / "config.json").read_text(encoding="utf-8"))


def teacher_params(cfg: Any) -> int:
    """Parameters of the run's distinct teachers (``trainer.teacher``, per env in a mixed
    run), each counted by its own shape; an endpoint's hold nothing here."""
    if getattr(cfg.algo, "distill_coef", 0) <= 0:
        return 0
    given = getattr(cfg, "per_env", {}).get("trainer.teacher") or [cfg.trainer.teacher]
    names = {str(n) for n in given if n and not str(n).startswith(("http://", "https://"))}
    return sum(shape_numbers(shape_of(n)[1]).params for n in sorted(names))


def setting_of(cfg: Any, gpus: int, device: str) -> Setting:
    t, r = cfg.trainer, cfg.rollout
    return Setting(
        device=device, gpus=gpus, backend=t.backend, zero_stage=t.zero_stage,
        offload=t.offload, checkpointing=cfg.model.gradient_checkpointing,
        micro_batch_tokens=t.micro_batch_tokens, logprob_chunk=t.logprob_chunk,
        packing=t.packing, lora_rank=cfg.model.lora.rank, reference=cfg.algo.kl_coef > 0,
        ref_offload=cfg.algo.ref_offload, critic=cfg.algo.needs_critic,
        teacher_params=teacher_params(cfg), teacher_bytes=4 if cfg.model.dtype == "float32" else 2,
        teacher_offload=getattr(cfg.algo, "teacher_offload", False),
        engine=cfg.engine.name == "hf",
        engine_dtype=engine_dtype(cfg.engine.dtype, cfg.model.dtype,
                                  HOST if device == "host" else ACCELERATOR),
        engine_packed=(device == "host" and cfg.engine.packed_weights
                       and cfg.engine.continuous_batching),  # static batches: not packed
        concurrency=r.max_concurrency,
        episode_tokens=r.max_prompt_tokens + r.max_response_tokens)


def parse_bytes(text: str) -> float:
    """``80GB``, ``80GiB``, ``24G``, ``512MB`` → bytes (GB and GiB both binary: a GPU sold
    as 80 GB shows about 80 GiB)."""
    import re
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"gpu_memory={text!r}: expected a size such as 80GB, 24GiB or 512MB")
    return float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B").upper())


def report(cfg: Any, gpus: int, capacity: float, device: str) -> list[str]:
    """The lines ``agentgym plan`` prints: the per-device breakdown, the verdict, and the
    cheapest change that fits when it does not."""
    where, config = shape_of(cfg.model.name)
    shape = shape_numbers(config)
    s = setting_of(cfg, gpus, device)
    auto = not s.micro_batch_tokens
    if auto:
        s = dataclasses.replace(s, micro_batch_tokens=auto_tokens(shape, s, capacity))
    rows = breakdown(shape, s)
    need = sum(b for _, b in rows)
    lines = [f"model {cfg.model.name} ({where}): {shape.params / 1e9:.2f}B parameters, "
             f"{shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}",
             f"per {device} device ({gpus} x {capacity / GiB:.0f} GiB; backend {s.backend}"
             f"{f' ZeRO-{s.zero_stage}' if s.backend == 'deepspeed' else ''}, micro-batch "
             f"{s.micro_batch_tokens} tokens{' (auto)' if auto else ''}, log-prob chunk "
             f"{s.logprob_chunk or 'off'}, "
             f"checkpointing {'on' if s.checkpointing else 'off'}):"]
    lines += [f"  {label:<48} {b / GiB:8.2f} GiB" for label, b in rows]
    lines.append(f"  {'total':<48} {need / GiB:8.2f} GiB of {capacity / GiB:.0f}")
    if need <= capacity:
        lines.append(f"verdict: fits ({(capacity - need) / GiB:.1f} GiB to spare)")
        return lines
    fix = cheapest_fit(shape, s, capacity)
    if fix is None:
        lines.append("verdict: does not fit, even with every change the planner knows "
                     "(more devices, a smaller model, or LoRA: model.lora.rank)")
        return lines
    changes, fitted = fix
    lines.append(f"verdict: does not fit ({need / GiB:.1f} GiB); cheapest change that fits: "
                 f"{' '.join(changes)} -> {total(shape, fitted) / GiB:.1f} GiB")
    return lines


def micro_batch_tokens(cfg: Any) -> int:
    """``trainer.micro_batch_tokens`` as the run uses it: as set, or when 0 (auto)
    :func:`auto_tokens` for the run's model and settings on its device (the whole device's
    memory: the run is taken to own it)."""
    t = cfg.trainer
    if t.micro_batch_tokens:
        return t.micro_batch_tokens
    device = run_device(cfg)
    if not is_accelerator(device):
        return AUTO_HOST_TOKENS
    capacity = total_memory_bytes(device)
    gpus = t.nprocs if t.backend in SHARDED_BACKENDS else 1
    s = setting_of(cfg, gpus, "gpu")
    tokens = auto_tokens(shape_numbers(shape_of(cfg.model.name)[1]), s, capacity)
    if (cfg.model.name, tokens) not in _SAID:
        _SAID.add((cfg.model.name, tokens))
        logger.info("trainer.micro_batch_tokens=0 (auto): %d tokens a micro-batch for %s on "
                    "%s (%.0f GiB)", tokens, cfg.model.name, device, capacity / GiB)
    return tokens


_SAID: set = set()
