"""Typed configuration: dataclasses are the single source of defaults.

The command line takes dotted ``key=value`` overrides (``rollout.temperature=0.7``).
Values are parsed as YAML scalars/lists and checked against the field's type. An unknown
key fails with the valid keys and a "did you mean". Shorthands: a plain value for a
section that has a ``name`` sets that name (``model=tiny`` is ``model.name=tiny``,
``engine=hf`` is ``engine.name=hf``, ``data=nq`` is ``data.name=nq``), and ``n=4`` is
``rollout.n=4``.

:class:`Config` is the whole shape, a typed field a section. The envs' sections (``search.*``,
``code.*`` …) are declared by their manifests (:mod:`agentgym.envs.manifest`); the shipped
envs' are fields too (a test keeps them equal), any other env's live in ``Config.sections``
and take overrides, errors and printing like the fields.

Precedence, lowest first: dataclass defaults, the environment's preset (its manifest's
``presets``: :func:`agentgym.presets.env_presets`), the command's own defaults (e.g.
``train``'s group of 5), the algorithm's preset (``algo=ppo``, :data:`ALGO_PRESETS`), a
recipe's keys (``recipe=search_r1_qwen2.5_3b_grpo``: ``recipes/``), the user's overrides.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from agentgym.core import choices
from agentgym.core.registry import check_choices, did_you_mean, env_names  # noqa: F401
from agentgym.supervision.watchdog import DeadlinesConfig
from agentgym.envs import config_sections, default_env, env_manifest
from agentgym.envs.manifest import MAX_TURNS
from agentgym.envs.code import CodeConfig, SandboxConfig  # the sandbox's: the code env's
from agentgym.envs.geometry import GeometryConfig
from agentgym.envs.judge import JudgeConfig  # reward=judge's
from agentgym.envs.mcp_env import MCPConfig
from agentgym.envs.openenv_env import OpenEnvConfig
from agentgym.envs.reasoning_gym_env import ReasoningGymConfig
from agentgym.envs.search import RetrieverConfig, SearchConfig
from agentgym.envs.swe import SWEConfig
from agentgym.envs.verifiers_env import VerifiersConfig
from agentgym.core.overrides import coerce
from agentgym.presets import (ALGO_PRESETS, ALIASES, FLOAT_PER_ENV_KEYS,  # noqa: F401
                              PER_ENV_KEYS, STR_PER_ENV_KEYS, env_presets, load_recipe)
from agentgym.core.device import check_device


@dataclass
class LoraConfig:
    """``model.lora.*``: LoRA adapters (peft) instead of training every weight."""

    rank: int = 0  # > 0: train rank-r adapters only (export and weight sync merge them); 0 = off
    alpha: float = 16.0  # scaling = alpha / rank
    dropout: float = 0.0  # > 0 makes the update's logprobs differ from the rollout's
    target_modules: str = "all-linear"  # peft module names, comma-separated, or all-linear

    def __post_init__(self) -> None:
        if self.rank < 0 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora: rank must be >= 0, alpha > 0, dropout in [0, 1); got "
                             f"{self.rank}, {self.alpha}, {self.dropout}")


#: ``org/name``: what a Hugging Face hub id looks like (a folder path has a leading ``/``,
#: ``.`` or ``~``, or exists)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # tiny | smollm2-135m | a local HF folder
    path: str = ""  # a local HF folder; overrides name when set
    dtype: str = "float32"  # float32 | bfloat16
    gradient_checkpointing: bool = False  # recompute each layer's activations in the backward (less memory)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_choices("model", self, {"dtype": ("float32", "bfloat16")})
        for key in ("name", "path"):
            value = getattr(self, key)
            if _HUB_ID.fullmatch(value) and not os.path.exists(os.path.expanduser(value)):
                raise ValueError(
                    f"model.{key}={value!r} is no folder here but reads as a Hugging Face hub "
                    f"id, and AgentGym downloads nothing while it runs: download it first "
                    f"(huggingface-cli download {value} --local-dir ~/models/"
                    f"{value.split('/')[1]}), then pass model=~/models/{value.split('/')[1]}; "
                    f"or a name of the model zoo (tiny, smollm2-135m, tiny:SHAPE)")


@dataclass
class EngineConfig:
    name: str = "hf"  # hf | sglang
    max_batch_size: int = 32
    batch_wait_s: float = 0.005  # hf: a batch starts after this long with no new request ...
    max_batch_wait_s: float = 0.05  # ... or this long after its first request
    continuous_batching: bool = True  # hf: requests join the running batch (false: static batches)
    prefix_cache: bool = True  # hf: reuse cached keys/values of prompt prefixes (radix tree)
    cache_tokens: int = 65536  # hf: prefix-cache budget in positions (smollm2-135m bf16: ~1.5 GB)
    prefill_chunk: int = 0  # hf: prompt tokens (padded) prefilled per step; 0: CPU 512, GPU 8192
    cuda_graphs: bool = True  # hf on a GPU: the decode step replayed as CUDA graphs
    packed_weights: bool = True  # hf on the CPU: linear weights copied once into oneDNN's blocked layout (faster decode; twice the weight memory)
    max_len: int = 0  # hf with CUDA graphs: positions per request in the KV pool; 0: the model's
    kv_fraction: float = 0.5  # hf with CUDA graphs: most of the free GPU memory the KV pool takes
    urls: list[str] = field(default_factory=list)  # sglang: servers; empty launches one (GPU)
    dtype: str = ""  # weights of the rollout copy; "" = model.dtype (bfloat16: faster, drifts)
    timeout_s: float = 600.0  # sglang: read timeout of one request
    retries: int = 3  # sglang: extra attempts after a connection error, timeout, 429/502/503/504
    retry_window_s: float = 60.0  # sglang: ... and more attempts until this long after the first
    weight_sync: str = "disk"  # sglang: disk | distributed | tensor (see agentgym.rollout.engines.sglang)
    sync_dir: str = ""  # sglang disk sync: folder every server can read; "" = a temp folder
    sync_address: str = ""  # sglang distributed sync: this host as servers reach it; "" = auto

    def __post_init__(self) -> None:
        check_choices("engine", self, {"dtype": ("", "float32", "bfloat16"),
                                       "weight_sync": choices.WEIGHT_SYNC_MODES})
        if isinstance(self.urls, str):  # engine.urls=http://a:1 (one server, no brackets)
            self.urls = [self.urls]
        if self.retries < 0:
            raise ValueError(f"engine.retries={self.retries}; must be >= 0")
        for key in ("cache_tokens", "max_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.{key}={getattr(self, key)}; must be >= 1")
        for key in ("prefill_chunk", "max_len"):
            if getattr(self, key) < 0:
                raise ValueError(f"engine.{key}={getattr(self, key)}; must be >= 0 (0: auto)")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"engine.kv_fraction={self.kv_fraction}; must be in (0, 1]")


@dataclass
class RolloutConfig:
    n: int = 1  # samples per prompt (GRPO group size)
    max_turns: int = MAX_TURNS  # env actions per episode (4; an env's manifest may preset its own)
    max_prompt_tokens: int = 1024
    max_response_tokens: int = 1024  # generated + observation tokens after the prompt
    max_tokens_per_turn: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_concurrency: int = 64  # trajectories in flight
    env_workers: int = 8  # threads for env.reset/step (tool calls)
    on_infra_error: str = "retry"  # a tool failure not the policy's: retry (replay once, then drop) | drop | keep
    # once an episode's context passes context_tokens: keep (it grows) | drop_observations
    # (older tool outputs replaced by a note) | summarize (the policy writes a summary) |
    # package.module:function (agentgym/rollout/context.py); the episode then continues
    # in a new trajectory, token-exact, sharing the episode's reward
    context: str = "keep"
    context_tokens: int = 0  # the context length that triggers rollout.context (> 0 unless keep)
    # trainer.mode=async: a generation in flight when new weights land stops and goes on
    # under them (hf engine, continuous batching); false: it finishes on the old weights first
    partial: bool = False

    def __post_init__(self) -> None:
        for name in ("n", "max_turns", "max_prompt_tokens", "max_response_tokens",
                     "max_tokens_per_turn", "max_concurrency", "env_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        check_choices("rollout", self, {"on_infra_error": choices.ON_INFRA_ERROR})
        if self.context not in choices.CONTEXT_STRATEGIES and ":" not in self.context:
            raise ValueError(f"rollout.context={self.context!r}; valid: "
                             f"{', '.join(choices.CONTEXT_STRATEGIES)}, or a function as "
                             f"package.module:function")

    def check_context(self) -> None:
        """``rollout.context`` other than keep needs ``rollout.context_tokens`` (checked once
        every key is set: either may come first)."""
        if self.context != "keep" and self.context_tokens < 1:
            raise ValueError(f"rollout.context={self.context} needs rollout.context_tokens >= 1 "
                             f"(the context length that triggers it), got {self.context_tokens}")


@dataclass
class AlgoConfig:
    """The algorithm. ``algo=NAME`` picks a preset (:data:`ALGO_PRESETS`) that sets the
    keys below; any of them can still be overridden (``algo=grpo algo.advantage=rloo``).
    The estimator decides whether a critic trains beside the policy (:attr:`needs_critic`)."""

    name: str = "grpo"  # preset: grpo | dr_grpo | rloo | reinforce_plus_plus | … | ppo
    advantage: str = "grpo"  # choices.ADVANTAGES: grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | gae | none (algo=opd) | turn-level: mt_grpo | gigpo | gae_turn
    norm_adv_by_std: bool = True  # grpo: divide by the group std (False = Dr. GRPO); gae: whiten over the batch
    gamma: float = 1.0  # discount per time step: a sampled token (gae, reinforce_plus_plus) or a turn (mt_grpo, gigpo, gae_turn)
    lam: float = 1.0  # GAE lambda (gae, gae_turn)
    step_weight: float = 1.0  # gigpo: weight of the step-level (anchor-state) advantage
    policy_loss: str = "ppo_clip"  # choices.POLICY_LOSSES: ppo_clip | dual_clip | gspo
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low is DAPO's clip-higher
    dual_clip: float = 3.0  # policy_loss=dual_clip: bound on the loss of negative advantages
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0  # 0 disables the reference model
    ref_offload: bool = False  # the reference model on the CPU (host memory) instead of the policy's device
    kl_estimator: str = "k3"  # k1 | k2 | k3 | abs
    kl_mode: str = "loss"  # loss (GRPO) | reward (a per-token penalty in the reward, PPO / REINFORCE++; use k1)
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_sampling_rounds: int = 4  # dynamic sampling: rollout rounds per step at most
    overlong_buffer: int = 0  # DAPO soft overlong punishment over the last N response tokens (0 = off)
    overlong_penalty: float = 1.0  # its largest penalty, reached at rollout.max_response_tokens
    # off-policy correction against the rollout's logprobs (stale or mismatched samples),
    # trainers/rollout_correction.py: recompute (none beyond recomputed old logprobs) |
    # decoupled (AReaL: x pi_prox/pi_behav) | truncated IS x min(ratio, is_cap): tis (token),
    # seq_tis (sequence: product), geo_tis (sequence: geometric mean) | masked IS x ratio
    # inside [is_low, is_high], else dropped: mis (token), seq_mis, geo_mis (whole sequence)
    off_policy: str = "recompute"
    is_cap: float = 2.0  # *_tis: weight cap; decoupled: cap too when > 0 (0 = uncapped)
    is_low: float = 0.5  # *_mis: the lowest ratio kept
    is_high: float = 2.0  # *_mis: the highest ratio kept
    # on-policy distillation (trainers/distill.py): each sampled token's advantage gains
    # distill_coef * (log p_teacher - log p_student) (trainer.teacher; 0 = none; algo=opd: alone)
    distill_coef: float = 0.0
    distill_discount: float = 0.0  # gamma over the following tokens' terms (0: the token's own, as the Tinker cookbook's kl_discount_factor)
    teacher_offload: bool = False  # the teacher in host memory instead of the policy's device (or the ranks)

    def __post_init__(self) -> None:
        check_choices("algo", self, {
            "name": tuple(ALGO_PRESETS), "advantage": tuple(choices.ADVANTAGES),
            "policy_loss": choices.POLICY_LOSSES, "loss_agg_mode": choices.LOSS_AGG_MODES,
            "kl_estimator": choices.KL_ESTIMATORS, "kl_mode": choices.KL_MODES,
            "off_policy": choices.OFF_POLICY_MODES})
        if not 0 < self.gamma <= 1:
            raise ValueError(f"algo.gamma must be in (0, 1], got {self.gamma}")
        if self.step_weight < 0:
            raise ValueError(f"algo.step_weight must be >= 0, got {self.step_weight}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"algo.lam must be in [0, 1], got {self.lam}")
        if self.off_policy.endswith("tis") and self.is_cap <= 0:
            raise ValueError(f"algo.is_cap must be > 0 for algo.off_policy={self.off_policy}, "
                             f"got {self.is_cap}")
        if not 0 <= self.is_low < 1 < self.is_high:
            raise ValueError(f"algo.is_low and algo.is_high must satisfy 0 <= is_low < 1 < "
                             f"is_high, got {self.is_low}, {self.is_high}")
        if self.dual_clip <= 1:
            raise ValueError(f"algo.dual_clip must be > 1, got {self.dual_clip}")
        if self.distill_coef < 0 or not 0 <= self.distill_discount <= 1:
            raise ValueError(f"algo.distill_coef must be >= 0 and algo.distill_discount in "
                             f"[0, 1], got {self.distill_coef}, {self.distill_discount}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"algo.clip_low must be in [0, 1) and algo.clip_high >= 0, got "
                             f"{self.clip_low}, {self.clip_high}")
        if self.max_sampling_rounds < 1:
            raise ValueError(f"algo.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"algo.overlong_buffer and algo.overlong_penalty must be >= 0, got "
                             f"{self.overlong_buffer}, {self.overlong_penalty}")

    @property
    def needs_critic(self) -> bool:
        """Whether the run trains a critic: its estimator's flag
        (:data:`agentgym.core.choices.ADVANTAGES`); the trainer and ``agentgym plan`` ask."""
        return choices.estimator(self.advantage).needs_critic


@dataclass
class CriticConfig:
    """The value model of ``algo=ppo`` (any estimator that reads values)."""

    model: str = ""  # "" = initialized from the policy's model; or tiny | smollm2-135m | a local HF folder
    lr: float = 1e-5
    warmup_steps: int = 0  # training steps that update only the critic (the policy waits)
    value_clip: float = 0.5  # PPO value clipping around the pre-update values (0 = off)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"critic.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0 or self.value_clip < 0:
            raise ValueError(f"critic.warmup_steps and critic.value_clip must be >= 0, got "
                             f"{self.warmup_steps}, {self.value_clip}")


@dataclass
class TrainerConfig:
    total_steps: int = 20
    prompts_per_step: int = 8  # rows per step; each sampled rollout.n times
    ppo_epochs: int = 1  # passes over each step's rollouts
    mini_batches: int = 1  # optimizer steps per epoch
    micro_batch_tokens: int = 0  # tokens per forward/backward (grad accumulation): packed ones, or padded with packing=false; 0: auto (4096 on the CPU; on a GPU the largest of 65536..4096 the memory planner fits in 80% of it)
    lr: float = 1e-6
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_every: int = 10  # steps between checkpoints (the last step is always saved)
    keep_checkpoints: int = 0  # the newest complete checkpoints kept in run_dir/checkpoints, older ones removed after each save (0: all; each holds the optimizer's state, 1.5 GB at 135M)
    eval_every: int = 0  # steps between evals on data.eval (0 = only before and after)
    eval_limit: int = 50
    eval_data: str = "nq"
    log_samples: int = 3  # trajectories per step written to run_dir/samples/ (worst, median, best; 0: none)
    logger: str = ""  # also log to: wandb (metrics, curves, sample tables; JSONL/TensorBoard/PNG always)
    mixed_precision: str = ""  # "" (bf16 on a GPU, fp32 on the CPU) | bf16 (autocast; fp32 master weights) | fp32
    device: str = "auto"  # auto (CUDA when available) | cpu | cuda | cuda:N (agentgym.core.device)
    logprob_chunk: int = 1024  # tokens whose vocabulary logits exist at once in log-prob passes (0: all)
    packing: bool = True  # one packed row per micro-batch (trainers/packing.py); false: padded rows
    seed: int = 0
    resume: str = "auto"  # auto (latest checkpoint in run_dir) | never | a checkpoint path
    backend: str = "single"  # single (this process) | fsdp (FSDP2) | deepspeed (ZeRO)
    nprocs: int = 1  # fsdp / deepspeed: rank processes on this machine (gloo on CPU, NCCL on GPU)
    zero_stage: int = 2  # deepspeed: ZeRO stage 1 | 2 | 3
    offload: bool = False  # fsdp: CPUOffloadPolicy (GPU runs); deepspeed: optimizer state on CPU
    mode: str = "sync"  # sync (roll out, then train) | async (rollouts keep going while training)
    max_staleness: int = 1  # async: policy versions a trained sample may lag behind (0 = on-policy)
    # on-policy distillation's teacher (trainers/distill.py, with algo.distill_coef > 0 or
    # algo=opd): a model folder, a run folder (its newest checkpoint), a zoo name, or an
    # endpoint answering SGLang's /generate with prompt logprobs (http://host:port); a list
    # in a mixed run, one per env in env order ("": that env not distilled)
    teacher: str = ""
    # Cold start (trainers/cold_start/): auto (probe the model's format validity on training
    # questions; below the threshold, build demonstrations and SFT first) | off | PATH (an SFT
    # checkpoint to start RL from). Results are cached by content under $AGENTGYM_CACHE.
    cold_start: str = "auto"
    cold_start_threshold: float = 0.5  # auto: probe format-validity below which it runs
    cold_start_probe: int = 8  # auto: greedy probe episodes (training questions)
    cold_start_demos: int = 64  # demonstrations the SFT trains on (sft.epochs, sft.batch_size)
    cold_start_lr: float = 1e-4  # the SFT's peak learning rate (cosine decay); a list in a mixed run: each env's demonstrations at their own rate

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0, got {self.max_staleness}")
        for name in ("total_steps", "prompts_per_step", "ppo_epochs", "mini_batches",
                     "save_every", "nprocs"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"trainer.micro_batch_tokens must be >= 1, or 0 for auto; got "
                             f"{self.micro_batch_tokens}")
        for name in ("warmup_steps", "eval_every", "eval_limit", "log_samples",
                     "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"trainer.lr must be > 0, got {self.lr}")
        check_choices("trainer", self, {"logger": ("", "tensorboard", "wandb")})
        if not self.cold_start:
            raise ValueError("trainer.cold_start is empty; valid: auto, off, or the folder of an "
                             "SFT checkpoint")
        if not 0 <= self.cold_start_threshold <= 1 or self.cold_start_lr <= 0:
            raise ValueError(f"trainer.cold_start_threshold must be in [0, 1] and "
                             f"trainer.cold_start_lr > 0; got {self.cold_start_threshold}, "
                             f"{self.cold_start_lr}")
        if self.cold_start_probe < 1 or self.cold_start_demos < 1:
            raise ValueError(f"trainer.cold_start_probe and trainer.cold_start_demos must be "
                             f">= 1; got {self.cold_start_probe}, {self.cold_start_demos}")
        check_choices("trainer", self, {
            "lr_schedule": choices.LR_SCHEDULES, "mixed_precision": choices.MIXED_PRECISIONS,
            "backend": choices.BACKENDS, "zero_stage": choices.ZERO_STAGES,
            "mode": ("sync", "async")})
        check_device(self.device)
        if self.logprob_chunk < 0:
            raise ValueError(f"trainer.logprob_chunk must be >= 0 (0: no chunking), got "
                             f"{self.logprob_chunk}")
        if self.backend == "single" and (self.nprocs > 1 or self.offload):
            raise ValueError(f"trainer.nprocs={self.nprocs} / trainer.offload={self.offload} "
                             f"need a sharded backend: trainer.backend=fsdp or deepspeed")


@dataclass
class RayConfig:
    """``ray.*``: Ray placement. Empty ``address`` = no Ray: one process (or the
    ``trainer.nprocs`` rank processes of a sharded backend)."""

    address: str = ""  # "" | local (start Ray here) | auto (join the running cluster) | host:port
    placement: str = "colocated"  # colocated (rollout workers share the train ranks' resources) | split
    rollout_workers: int = 1  # rollout actors, each an engine + generation manager + envs
    cpus: float = 1.0  # CPUs per train rank and per rollout worker
    gpus: float = 0.0  # GPUs per train rank and per rollout worker (colocated: they share)

    def __post_init__(self) -> None:
        check_choices("ray", self, {"placement": ("colocated", "split")})
        if self.rollout_workers < 1 or self.cpus <= 0 or self.gpus < 0:
            raise ValueError(f"ray.rollout_workers must be >= 1, ray.cpus > 0, ray.gpus >= 0; "
                             f"got {self.rollout_workers}, {self.cpus}, {self.gpus}")


@dataclass
class SFTConfig:
    """``agentgym sft`` (supervised cold start), ``agentgym demos`` and ``agentgym filter``."""

    epochs: int = 2
    batch_size: int = 8  # sequences per optimizer step (micro-batched by trainer.micro_batch_tokens)
    max_steps: int = 0  # optimizer steps; 0 = epochs x ceil(records / batch_size)
    max_length: int = 2048  # longer sequences are left out (counted and logged)
    group_by_length: bool = True  # length-bucketed batches, so padding stays small
    min_reward: float = 1.0  # filter: keep trajectories whose reward is at least this
    max_per_prompt: int = 0  # filter: kept trajectories per prompt (0 = all)
    max_searches: int = 2  # demos env=search: queries tried (the question, then a rewrite)
    max_cells: int = 3  # demos env=code: code cells a GSM8K solution is split into
    eval_limit: int = 0  # held-out episodes (trainer.eval_data) played greedily after SFT; 0 = none

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_length", "max_searches", "max_cells"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "max_per_prompt", "eval_limit"):
            if getattr(self, name) < 0:
                raise ValueError(f"sft.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class DataConfig:
    """``data``: what a command reads (``data=nq`` is ``data.name=nq``)."""

    name: str = "train"  # dataset name of the env (train | nq | …) or a .jsonl path (sft: records)
    # search, training rows, the shipped corpus: keep the questions whose gold answer occurs
    # in the corpus (the others earn 0 from every rollout: no GRPO signal). No effect with
    # retriever.url / retriever.index (another corpus) or other envs.
    answerable_only: bool = True
    # env=[search,code]: the share of each env's prompts, in env order (empty: equal)
    mix: list[float] = field(default_factory=list)
    curriculum: str = ""  # "" (rows in order) | solve_rate (trainers/curriculum.py)
    curriculum_band: list[float] = field(default_factory=lambda: [0.2, 0.8])  # solve rates kept

    def __post_init__(self) -> None:
        if any(not isinstance(w, (int, float)) or w <= 0 for w in self.mix):
            raise ValueError(f"data.mix={self.mix!r}: weights must be > 0")
        check_choices("data", self, {"curriculum": ("", "solve_rate")})
        if len(band := self.curriculum_band) != 2 or not 0 <= band[0] < band[1] <= 1:
            raise ValueError(f"data.curriculum_band={band!r}: give [low, high], 0 <= low < high <= 1")


def _env_sections() -> dict[str, Any]:
    """The discovered envs' sections that :class:`Config` has no field for, at defaults."""
    typed = _field_names(Config)
    return {name: cls() for name, cls in config_sections().items() if name not in typed}


@dataclass
class Config:
    """The whole config: the run's sections and keys, the shipped envs' sections (equal to
    their manifests': tests/test_config_sections.py), :attr:`sections` for other envs'."""

    env: str = field(default_factory=default_env)  # the env whose manifest sets default
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # judge (a model grades: judge.*), or package.module:function with verl's custom-reward signature, replacing the env's
    # reward at each episode's end (envs.plugins.RewardOverride); "" = the env's own
    reward: str = ""
    # run reward= in a process of its own each call: past deadlines.env_step_s it is killed with
    # its process group (a thread cannot be; agentgym.supervision.process_call)
    reward_process: bool = False
    agent: str = ""  # env=agent: the agent program, package.module:run (agentgym.serving.agents)
    limit: int = 0  # rows to use; 0 = all
    out: str = ""  # output file (rollout: trajectories JSONL; eval: results JSON)
    run_dir: str = ""  # train: default runs/<env>-<model>-<time>
    log_level: str = "WARNING"
    # a mixed run's values per env, in env order, for presets.PER_ENV_KEYS (set as lists:
    # rollout.max_turns=[4,2]); the key itself holds the largest (a string key: the first given)
    per_env: dict[str, list[int | float | str]] = field(default_factory=dict)
    recipe: str = ""  # recipes/NAME.yaml (or a .yaml path) layered under the user's keys
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)  # stall detection
    # the shipped envs' sections (envs/code.py, geometry.py, mcp_env.py, openenv_env.py,
    # reasoning_gym_env.py, search.py, swe.py, verifiers_env.py)
    code: CodeConfig = field(default_factory=CodeConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    geometry: GeometryConfig = field(default_factory=GeometryConfig)
    mcp: MCPConfig = field(default_factory=MCPConfig)
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    retriever: RetrieverConfig = field(default_factory=RetrieverConfig)
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    swe: SWEConfig = field(default_factory=SWEConfig)
    # other envs' sections (one added under envs/, a plugin's once chosen), used as fields
    sections: dict[str, Any] = field(default_factory=_env_sections)

    def section(self, name: str) -> Any:
        """The section (or run-level key) ``name``: a field, or one of :attr:`sections`."""
        return _children(self)[name]


def add_env_sections(cfg: Config, env: Any) -> None:
    """Give ``cfg`` the sections the env(s) ``env`` declare that it lacks, at their defaults
    (a plugin's); a name that another section or key holds fails."""
    for name in env_names(env):
        try:
            declared, have = env_manifest(name).sections, _children(cfg)
        except KeyError:  # an unknown env: the commands' own check names the valid ones
            continue
        for key, cls in declared.items():
            if key not in have:
                cfg.sections[key] = have[key] = cls()
            if type(have[key]) is not cls:
                raise ValueError(f"env {name}'s config section {key!r} is already "
                                 f"{type(have[key]).__name__}'s; an env needs a name of its own")


def _children(node: Any) -> dict[str, Any]:
    """``node``'s keys and values: its fields (the config's: with its :attr:`sections`)."""
    out = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, Config):
        del out["sections"]
        out.update(node.sections)
    return out


def _field_names(obj: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config, e.g. ``rollout.temperature``."""
    keys = []
    for name, value in _children(obj).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(value):
            keys.extend(all_keys(value, prefix + name + "."))
    return keys


def set_key(cfg: Any, key: str, value: Any) -> None:
    """Set a dotted key on a config tree (value already parsed from YAML). A list for one
    of :data:`PER_ENV_KEYS` is a mixed run's value per env (``cfg.per_env``)."""
    key = ALIASES.get(key, key)
    if key in PER_ENV_KEYS and hasattr(cfg, "per_env"):
        cfg.per_env.pop(key, None)
        if isinstance(value, list):
            if key in STR_PER_ENV_KEYS:  # the key holds the first given (set: any is)
                cfg.per_env[key] = ["" if v is None else str(v) for v in value]
                value = next((v for v in cfg.per_env[key] if v), "")
            else:
                kind = float if key in FLOAT_PER_ENV_KEYS else int
                cfg.per_env[key] = [coerce(key, v, kind) for v in value]
                value = max(cfg.per_env[key], default=0)
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        children = _children(node)
        if part not in children:
            where = ".".join(parts[:i]) or "config"
            valid = all_keys(cfg)
            raise KeyError(f"unknown config key {key!r}{did_you_mean(key, valid)}; "
                           f"{where} has: {', '.join(children)}")
        if i == len(parts) - 1:
            current = children[part]
            if dataclasses.is_dataclass(current):
                if "name" not in _field_names(current) or isinstance(value, dict):
                    raise ValueError(f"{key} is a section; set its keys, e.g. "
                                     f"{key}.{_field_names(current)[0]}=…")
                node, part = current, "name"
            hints = typing.get_type_hints(type(node))
            setattr(node, part, coerce(key, value, hints[part]))
            if hasattr(node, "__post_init__"):
                node.__post_init__()  # re-validate the section
        else:
            node = children[part]


def is_mixed(cfg: Any) -> bool:
    """Whether ``cfg`` is a mixed run (several envs)."""
    return len(env_names(cfg.env)) > 1


def build_config(overrides: dict[str, Any], command_defaults: dict[str, Any] | None = None,
                 cls: type = Config) -> Any:
    """Defaults → env preset → command defaults → algorithm preset → recipe (``recipe=``,
    :func:`agentgym.presets.load_recipe`) → user overrides."""
    cfg = cls()
    recipe = load_recipe(overrides["recipe"]) if "recipe" in overrides else {}
    env = overrides.get("env", recipe.get("env", cfg.env))
    if isinstance(cfg, Config):
        add_env_sections(cfg, env)  # a plugin env's sections, before its keys are set
    mixed = len(env_names(env)) > 1
    if mixed:  # a mixed run: one name for it, and no single env's preset
        overrides = {**overrides, "env": ",".join(env_names(env))}
    layers = [{} if mixed else env_presets(str(env)), command_defaults or {}]
    algo = overrides.get("algo.name", overrides.get("algo",
                                                    recipe.get("algo.name", recipe.get("algo"))))
    if hasattr(cfg, "algo") and isinstance(algo, str):
        set_key(cfg, "algo.name", algo)  # fails with the valid names before the preset
        layers.append(ALGO_PRESETS[algo])
    layers += [recipe, overrides]
    for layer in layers:
        for k, v in layer.items():
            set_key(cfg, k, v)
    for key, values in getattr(cfg, "per_env", {}).items():
        if len(values) != len(env_names(cfg.env)):
            raise ValueError(f"{key}={values} gives {len(values)} values for the "
                             f"{len(env_names(cfg.env))} env(s) of env={cfg.env}; a list "
                             f"gives one per env of a mixed run, in env order")
    if hasattr(cfg, "rollout"):
        cfg.rollout.check_context()
    if getattr(cfg, "reward_process", False) and not cfg.reward:
        raise ValueError("reward_process=true runs the reward= function in a process of its "
                         "own, but no reward= is given; give reward=package.module:function")
    return cfg


def to_dict(cfg: Any) -> dict:
    """``cfg`` as plain data, :attr:`Config.sections` beside the fields (as in ``key=value``)."""
    out = dataclasses.asdict(cfg)
    if isinstance(cfg, Config):
        out.update(out.pop("sections"))
    return out
