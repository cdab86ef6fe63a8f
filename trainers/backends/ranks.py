"""One rank's share of a sharded model: FSDP2 (``fully_shard``) or DeepSpeed ZeRO.

These classes live inside rank processes (started by :mod:`agentgym.trainers.backends.distributed`
or as Ray actors); the recipe never sees them. Every rank of a step receives the same
number of micro-batches (``None`` entries stand for a zero-weight dummy), because each
forward and backward pass of a sharded model is a collective: a rank with less work
still has to join every all-gather and reduce-scatter.

Gradients: each micro-batch loss is already normalized by the *mini-batch* totals, so
the sum of all micro-batch losses over all ranks is the mini-batch loss. Both FSDP2 and
ZeRO average gradients over ranks, so each rank scales its loss by the world size; the
result equals the single-process gradient (tested against ``SingleBackend``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from agentgym.core.choices import ZERO_STAGES
from agentgym.core.device import HOST, is_accelerator, resolve_device
from agentgym.core.memory import give_back
from agentgym.trainers import lora
from agentgym.trainers.backends.base import (LossFn, ModelSpec, add_metrics, as_floats,
                                             make_adamw, scale_this_step)
from agentgym.trainers.batch import Batch
from agentgym.trainers.backends.single import lr_lambda

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimSpec:
    """Optimizer, schedule and sharding options, the same on every rank."""

    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    total_steps: int = 1
    schedule: str = "constant"
    max_grad_norm: float = 1.0
    mixed_precision: str = ""  # "" (fp32) | bf16
    zero_stage: int = 2  # deepspeed only
    offload: bool = False  # fsdp: params/grads/optimizer on CPU (GPU runs); deepspeed: optimizer on CPU


def device_for(spec: ModelSpec, rank: int) -> torch.device:
    """The rank's device: ``trainer.device`` resolved with the rank's local index
    (``cuda:<LOCAL_RANK>`` on a GPU machine under ``auto``, else the CPU)."""
    return resolve_device(spec.device, int(os.environ.get("LOCAL_RANK", rank)))


def _trainable(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates (LoRA: the adapters only)."""
    return [p for p in model.parameters() if p.requires_grad]


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The model's transformer blocks (the classes it declares as ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules; cannot find "
                         f"its decoder layers to shard")
    return layers


class RankBackend:
    """The shared loop of a sharded backend; subclasses provide the model wrapping,
    backward, optimizer step, full state dict and sharded save/load."""

    module: torch.nn.Module  # what forward passes call
    world: int
    spec: ModelSpec
    _reference: torch.nn.Module | None = None
    _teachers: dict | None = None  # on-policy distillation's teachers, by folder

    def autocast(self):
        return torch.autocast(self.device.type, enabled=False)

    def reference(self) -> torch.nn.Module:
        """The frozen KL reference, loaded on first use and placed as the policy is
        (:meth:`wrap_reference`): the starting weights, without LoRA adapters."""
        if self._reference is None:
            ref = replace(self.spec, lora=None, gradient_checkpointing=False).load(self.device)
            ref.requires_grad_(False)
            self._reference = self.wrap_reference(ref).eval()
        return self._reference

    def teacher(self, spec: ModelSpec) -> torch.nn.Module:
        """On-policy distillation's teacher ``spec`` (a model of its own shape), loaded on
        first use and placed as the reference is (:meth:`wrap_reference`)."""
        self._teachers = self._teachers or {}
        if spec.path not in self._teachers:
            model = replace(spec, lora=None, gradient_checkpointing=False).load(self.device)
            model.requires_grad_(False)
            self._teachers[spec.path] = self.wrap_reference(model).eval()
        return self._teachers[spec.path]

    @torch.no_grad()
    def apply(self, fn, micro: list[Batch | None], dummy: Batch,
              model: "str | ModelSpec" = "policy") -> list[tuple | None]:
        """``fn(model, mb, device)`` on each micro-batch (``None``: run on ``dummy`` to join
        the collectives, return None); ``model``: ``policy``, ``reference``, or a teacher's
        :class:`ModelSpec`."""
        if isinstance(model, ModelSpec):
            module = self.teacher(model)
        elif model in ("policy", "reference"):
            module = self.module if model == "policy" else self.reference()
        else:
            raise ValueError(f"model={model!r}; valid: policy, reference, or a teacher's ModelSpec")
        module.eval()
        out = []
        try:
            for mb in micro:
                with self.autocast():
                    res = fn(module, mb if mb is not None else dummy, self.device)
                out.append(None if mb is None else tuple(r.detach().cpu() for r in res))
        finally:
            if model == "policy":
                self.module.train()
        return out

    def train_step(self, micro: list[Batch | None], loss_fn: LossFn,
                   dummy: Batch, lr_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (see the module docstring)."""
        self.module.train()
        self.zero_grad()
        totals: dict = {}
        for mb in micro:
            with self.autocast():
                loss, metrics = loss_fn(self.module, mb if mb is not None else dummy)
            if mb is None:
                loss, metrics = loss * 0.0, {}
            self.backward(loss * self.world)
            add_metrics(totals, {**metrics, "loss": loss.detach()})
        grad_norm, lr = self.step(lr_scale)
        out = as_floats({**totals, "grad_norm": grad_norm, "lr": lr})  # one host sync
        give_back()  # the step's freed memory, back to the system (agentgym.core.memory)
        return out

    def export_hf(self, path: str) -> None:
        """HF weights (``save_pretrained``) of the full model, written by rank 0; with
        LoRA merged, and the adapters in peft's format in ``adapter/``."""
        sd = self.gathered_state_dict()
        if sd is None:
            return
        model = self.hf_module()
        if lora.is_lora(model):
            lora.save_adapter_from_state_dict(model, sd, Path(path) / "adapter")
            model, sd = model.get_base_model(), lora.merge_state_dict(sd, lora.scaling_of(model))
        model.save_pretrained(path, state_dict=_without_tied_copies(model, sd),
                              safe_serialization=True)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (None elsewhere); with LoRA, the base
        architecture's with the adapters merged (what the rollout engine loads)."""
        sd = self.gathered_state_dict()
        model = self.hf_module()
        if sd is not None and lora.is_lora(model):
            sd = lora.merge_state_dict(sd, lora.scaling_of(model))
        return sd

    # -- provided by subclasses ---------------------------------------------------------
    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, lr_scale: float = 1.0) -> tuple[float, float]: ...
    def gathered_state_dict(self) -> dict[str, torch.Tensor] | None: ...
    def hf_module(self): ...
    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...


def _without_tied_copies(model, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the tied copies (``lm_head.weight`` when the embeddings are tied): a gathered
    state dict holds them as separate tensors, which ``save_pretrained`` would write,
    while the single backend's (shared storage) leaves them out; either way
    ``from_pretrained`` re-ties them, but a checkpoint should not depend on the backend."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    if not getattr(text, "tie_word_embeddings", False):
        return sd
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return {k: v for k, v in sd.items() if k not in tied}


def _scheduler(optimizer, o: OptimSpec):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(o.warmup_steps, o.total_steps, o.schedule))


class FSDPRank(RankBackend):
    """FSDP2: each decoder layer and the root are ``fully_shard``-ed over all ranks;
    bf16 through ``MixedPrecisionPolicy`` (fp32 reductions), CPU offload through
    ``CPUOffloadPolicy`` (GPU runs)."""

    def __init__(self, spec: ModelSpec, o: OptimSpec, rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        self.rank, self.world, self.o, self.spec = rank, world, o, spec
        self.device = device_for(spec, rank)
        if o.offload and not is_accelerator(self.device):
            raise ValueError("trainer.offload with trainer.backend=fsdp moves parameters to "
                             "the CPU, so it needs a GPU run; on CPU leave trainer.offload=false")
        model = spec.load(self.device)
        mesh = init_device_mesh(self.device.type, (world,))
        kw = {"mesh": mesh}
        if o.mixed_precision == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if o.offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        self._shard_kw = kw
        self.module = self.wrap_reference(model)
        self.optimizer = make_adamw(_trainable(model), lr=o.lr, betas=o.betas,
                                    weight_decay=o.weight_decay)
        self.scheduler = _scheduler(self.optimizer, o)

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard ``model`` as the policy is: each decoder layer, then the root (the policy
        goes through here too, so the reference is sharded over the same mesh, precision
        and offload)."""
        from torch.distributed.fsdp import fully_shard
        for layer in _decoder_layers(model):
            fully_shard(layer, **self._shard_kw)
        fully_shard(model, **self._shard_kw)
        return model

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr_scale: float = 1.0) -> tuple[float, float]:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            params, self.o.max_grad_norm if self.o.max_grad_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0] * lr_scale
        scale_this_step(self.optimizer, self.scheduler, lr_scale)
        self.optimizer.step()
        self.scheduler.step()
        return norm, lr  # a tensor: train_step's one host sync reads it

    def gathered_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
        return sd if self.rank == 0 else None

    def hf_module(self):
        return self.module

    def save(self, path: str) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint) and the scheduler."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(path) / "fsdp"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(path) / "fsdp_scheduler.pt")
        dist.barrier()

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        if not (Path(path) / "fsdp").is_dir():
            raise ValueError(f"checkpoint {path} holds no FSDP state (fsdp/): it was written by "
                             f"another trainer.backend; resume with that backend")
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(path) / "fsdp"))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(torch.load(Path(path) / "fsdp_scheduler.pt",
                                                  weights_only=False))


class DeepSpeedRank(RankBackend):
    """DeepSpeed ZeRO stage 1/2/3 with caller-owned gradient accumulation
    (``managed_gradient_accumulation: false``: ``backward`` accumulates, ``step`` is the
    boundary), our AdamW and LR schedule, optional optimizer offload to CPU."""

    def __init__(self, spec: ModelSpec, o: OptimSpec, rank: int, world: int) -> None:
        import deepspeed
        self.rank, self.world, self.o, self.spec = rank, world, o, spec
        self.device = device_for(spec, rank)
        if o.zero_stage not in ZERO_STAGES:
            raise ValueError(f"trainer.zero_stage={o.zero_stage}; valid: "
                             f"{', '.join(map(str, ZERO_STAGES))}")
        zero = {"stage": o.zero_stage}
        if o.offload:
            zero["offload_optimizer"] = {"device": HOST}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "managed_gradient_accumulation": False, "zero_optimization": zero,
                  "gradient_clipping": o.max_grad_norm, "bf16": {"enabled": o.mixed_precision == "bf16"},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
                  "wall_clock_breakdown": False}
        model = spec.load(self.device)
        if o.offload:  # ZeRO-offload steps on the CPU with DeepSpeed's own Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(_trainable(model), lr=o.lr, betas=o.betas,
                                   weight_decay=o.weight_decay, adamw_mode=True)
        else:
            opt = make_adamw(_trainable(model), lr=o.lr, betas=o.betas,
                             weight_decay=o.weight_decay)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=lambda opt_: _scheduler(opt_, o),
            config=config)
        self.module = self.engine

    def autocast(self):
        # DeepSpeed's bf16 mode keeps bf16 weights; the loss code's fp32 casts stay as is
        return torch.autocast(self.device.type, enabled=False)

    def wrap_reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A whole copy per rank, in the policy's weight precision. ZeRO-1/2 keep whole
        weights on every rank anyway; under ZeRO-3 this copy is not partitioned (an
        inference-only ZeRO-3 engine for it is not built here)."""
        if self.o.mixed_precision == "bf16":
            model = model.to(torch.bfloat16)
        return model

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, lr_scale: float = 1.0) -> tuple[float, float]:
        lr = self.engine.get_lr()[0] * lr_scale
        scale_this_step(self.engine.optimizer, self.engine.lr_scheduler, lr_scale)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else 0.0), lr

    def gathered_state_dict(self):
        import deepspeed
        module = self.engine.module
        if self.o.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                sd = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} \
                    if self.rank == 0 else None
            return sd
        # stages 1 and 2 keep whole weights on every rank (bf16 ones under bf16 mode)
        return ({k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
                if self.rank == 0 else None)

    def hf_module(self):
        return self.engine.module

    def save(self, path: str) -> None:
        self.engine.save_checkpoint(str(Path(path) / "deepspeed"), tag="state")
        dist.barrier()

    def load(self, path: str) -> None:
        if not (Path(path) / "deepspeed").is_dir():
            raise ValueError(f"checkpoint {path} holds no DeepSpeed state (deepspeed/): it was "
                             f"written by another trainer.backend; resume with that backend")
        self.engine.load_checkpoint(str(Path(path) / "deepspeed"), tag="state",
                                    load_optimizer_states=True, load_lr_scheduler_states=True)


RANK_BACKENDS = {"fsdp": FSDPRank, "deepspeed": DeepSpeedRank}
