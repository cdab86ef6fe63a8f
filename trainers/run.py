"""What every training recipe (GRPO, PPO, SFT) shares: the run directory, atomic
checkpoints and resume, weight sync into the rollout engine, greedy evaluation and the
progress hooks the CLI draws from."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentgym.config import Config, is_mixed, to_dict
from agentgym.manager import GenerationManager, summarize
from agentgym.runtime import env_factory

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


class Hooks:
    """Progress callbacks; the CLI draws bars and prints from them (library code logs)."""

    def phase(self, name: str, total: int) -> None: ...
    def advance(self, k: int = 1) -> None: ...
    def step_end(self, step: int, metrics: dict) -> None: ...
    def announce(self, text: str) -> None:
        """A stage starts, or a fact the user should see (the CLI prints it)."""
        logger.info("%s", text)


def resolve_run_dir(cfg: Config) -> Path:
    if cfg.run_dir:
        return Path(cfg.run_dir)
    model = Path(cfg.model.path or cfg.model.name).name
    from agentgym.config import env_names
    env = "+".join(env_names(cfg.env)).replace(":", "-").replace("/", "-")
    return Path("runs") / f"{env}-{model}-{time.strftime('%Y%m%d-%H%M%S')}"


def start_run(cfg: Config) -> Path:
    """Create the run directory, write the resolved config, seed ``random`` and torch."""
    run_dir = resolve_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    logger.info("run dir %s; config %s", run_dir, json.dumps(to_dict(cfg)))
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    return run_dir


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``checkpoints/step_N`` (``.tmp`` leftovers are ignored)."""
    found = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        m = _STEP_DIR.match(p.name)
        if m and (p / "state.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def resume(policy: str, run_dir: Path, backend, critic=None) -> dict[str, Any]:
    """Load the checkpoint ``trainer.resume`` names (auto: the latest in ``run_dir``;
    never; or a path) into ``backend`` (and ``critic``'s backend from its ``critic/``
    folder); return its ``state.json`` (``{"step": 0}`` when there is none)."""
    ckpt = latest_checkpoint(run_dir) if policy == "auto" else (
        None if policy == "never" else Path(policy))
    if ckpt is None:
        return {"step": 0}
    backend.load(ckpt)
    if critic is not None:
        if not (ckpt / "critic").is_dir():
            raise ValueError(f"checkpoint {ckpt} has no critic/ folder, so a critic-based "
                             f"algorithm cannot resume from it; start a new run_dir or set "
                             f"trainer.resume=never")
        critic.load(ckpt / "critic")
    state = json.loads((ckpt / "state.json").read_text())
    if (ckpt / "rng.pt").exists():
        set_rng_state(torch.load(ckpt / "rng.pt", weights_only=False))
    logger.info("resumed from %s at step %d", ckpt, state["step"])
    return state


def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, NumPy's and torch's."""
    import numpy as np
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(run_dir: Path, step: int, backend, tokenizer,
                    state: dict[str, Any] | None = None, critic=None) -> Path:
    """``run_dir/checkpoints/step_N``: HF weights + tokenizer + the backend's optimizer
    and scheduler state (sharded for fsdp/deepspeed) + the driver's RNG states
    (``rng.pt``) + ``state.json`` (step, data position, policy version), and the
    critic's in ``critic/`` when there is one.

    Written to ``step_N.tmp`` and renamed into place, so a kill mid-save leaves nothing
    that ``trainer.resume=auto`` would pick up (it only reads ``step_<digits>`` folders).
    """
    final = run_dir / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # a leftover of a killed save
    backend.save(tmp, tokenizer=tokenizer)
    source = Path(getattr(tokenizer, "name_or_path", "") or ".")
    if (source / "preprocessor_config.json").is_file():  # a VL model's image processor
        shutil.copy2(source / "preprocessor_config.json", tmp / "preprocessor_config.json")
    if critic is not None:
        critic.save(tmp / "critic")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({**(state or {}), "step": step}) + "\n")
    if final.exists():  # re-saving a step (after a resume): move the old one aside first
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    logger.info("saved checkpoint %s", final)
    return final


async def rollouts(manager: GenerationManager, rows: list[dict], n: int, hooks: Hooks):
    hooks.phase("rollout", len(rows) * n)
    return await manager.run(rows, n=n, on_done=lambda _t: hooks.advance())


def split_by_env(trajs: list) -> dict[str, list]:
    """Trajectories by the env that played them (``info["env"]``), in first-seen order."""
    out: dict[str, list] = {}
    for t in trajs:
        out.setdefault(str(t.info.get("env", "")), []).append(t)
    return out


def eval_metrics(trajs: list, per_env: bool = False) -> dict:
    """``eval/*`` over ``trajs``; a mixed run's also env by env (``search/eval/em``, ...)."""
    s = summarize(trajs)
    m = {"eval/em": s["em"], "eval/f1": s["f1"], "eval/format_valid": s["format_valid"],
         "eval/count": s["count"]}
    if per_env:
        for env, part in split_by_env(trajs).items():
            m.update({f"{env}/{k}": v for k, v in eval_metrics(part).items()})
    return m


def evaluate(cfg: Config, engine, tokenizer, rows: list[dict], hooks: Hooks) -> dict:
    """Greedy single-sample accuracy on ``rows`` (the same env, budgets and tools)."""
    rollout = LocalRollout(cfg, engine, tokenizer)
    try:
        return eval_metrics(rollout.generate(rows, 1, cfg.trainer.seed, hooks, greedy=True),
                            per_env=is_mixed(cfg))
    finally:
        rollout.close(engine_too=False)


class LocalRollout:
    """Rollouts in this process: the engine and a generation manager (the default; Ray
    puts the same in actors, :mod:`trainers.ray_cluster`).

    ``generate(rows, n, seed, hooks, greedy)`` plays ``n`` samples of every row (greedy:
    temperature 0, one sample; the eval mode); ``update_weights(state_dict, version)``
    swaps the engine's weights with generation paused.
    """

    def __init__(self, cfg: Config, engine, tokenizer) -> None:
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self._managers: dict = {}  # greedy (bool) or "async" -> manager
        self._managers_lock = threading.Lock()  # run_group may run in several actor threads
        #: the engine's weights live in servers (which may hold anything at start)
        self.remote = not engine.needs_model

    def _manager(self, greedy: bool) -> GenerationManager:
        if greedy not in self._managers:
            cfg = self.cfg
            if greedy:
                cfg = copy.deepcopy(cfg)
                cfg.rollout = dataclasses.replace(cfg.rollout, temperature=0.0, n=1)
            self._managers[greedy] = GenerationManager(self.engine, self.tokenizer,
                                                       env_factory(cfg), cfg.rollout,
                                                       seed=cfg.trainer.seed)
        return self._managers[greedy]

    def generate(self, rows: list[dict], n: int, seed: int, hooks: Hooks,
                 greedy: bool = False) -> list:
        manager = self._manager(greedy)
        manager.seed = seed
        return asyncio.run(rollouts(manager, rows, n, hooks))

    async def run_group(self, row: dict, uid: str, n: int, seed: int) -> list:
        """``n`` samples of one row with base seed ``seed`` (asynchronous training: may run
        across weight updates, each turn tagged with its version)."""
        with self._managers_lock:
            if "async" not in self._managers:
                self._managers["async"] = GenerationManager(
                    self.engine, self.tokenizer, env_factory(self.cfg), self.cfg.rollout,
                    seed=self.cfg.trainer.seed, allow_weight_updates=True)
            manager = self._managers["async"]
        return list(await asyncio.gather(*(manager.rollout(row, uid, k, base_seed=seed)
                                           for k in range(n))))

    def update_weights(self, state_dict: dict, version: int) -> None:
        from agentgym.engines.base import push_weights
        push_weights(self.engine, state_dict, version)

    def close(self, engine_too: bool = True) -> None:
        for manager in self._managers.values():
            manager.close()
        self._managers = {}
        if engine_too:
            self.engine.close()


def make_backend(cfg: Config, spec, lr: float, cluster=None, total_steps: int | None = None,
                 warmup_steps: int | None = None):
    """The training backend (``trainer.backend``: single, or fsdp/deepspeed over
    ``trainer.nprocs`` rank processes, or rank actors of a Ray ``cluster``) for the model
    ``spec`` (a :class:`~trainers.backends.base.ModelSpec`) describes. The LR schedule
    counts optimizer steps: by default ``trainer.total_steps`` / ``trainer.warmup_steps``
    times the optimizer steps per training step (``ppo_epochs x mini_batches``)."""
    from agentgym.device import mixed_precision, resolve_device
    from trainers.backends.single import SingleBackend
    t = cfg.trainer
    k = t.ppo_epochs * t.mini_batches
    precision = mixed_precision(t.mixed_precision, resolve_device(t.device))
    total = total_steps if total_steps is not None else t.total_steps * k
    warmup = warmup_steps if warmup_steps is not None else t.warmup_steps * k
    if t.backend == "single":
        return SingleBackend(spec.load(), lr=lr, weight_decay=t.weight_decay,
                             warmup_steps=warmup, total_steps=total,
                             schedule=t.lr_schedule, max_grad_norm=t.max_grad_norm,
                             micro_batch_tokens=t.micro_batch_tokens,
                             mixed_precision=precision, logprob_chunk=t.logprob_chunk)
    from trainers.backends.distributed import DistributedBackend
    from trainers.backends.ranks import OptimSpec
    optim = OptimSpec(lr=lr, weight_decay=t.weight_decay, warmup_steps=warmup,
                      total_steps=total, schedule=t.lr_schedule,
                      max_grad_norm=t.max_grad_norm, mixed_precision=precision,
                      zero_stage=t.zero_stage, offload=t.offload)
    ranks = None
    if cluster is not None:
        from trainers.ray_cluster import RayRanks
        ranks = RayRanks(cluster, t.nprocs, t.backend, spec, optim,
                         "critic" if spec.kind == "value" else "policy")
    return DistributedBackend(t.backend, spec, optim, t.nprocs, t.micro_batch_tokens, ranks,
                              logprob_chunk=t.logprob_chunk)


def policy_spec(cfg: Config, path):
    """The policy as the backends load it: ``model.dtype``, and LoRA adapters when
    ``model.lora.rank`` > 0 (their init seeded with ``trainer.seed``)."""
    from trainers.backends.base import ModelSpec
    from trainers.lora import LoraSpec
    lo = cfg.model.lora
    return ModelSpec(str(path), cfg.model.dtype, lora=LoraSpec(
        lo.rank, lo.alpha, lo.dropout, lo.target_modules, cfg.trainer.seed) if lo.rank else None,
        device=cfg.trainer.device, gradient_checkpointing=cfg.model.gradient_checkpointing)


@dataclass
class Reference:
    """The frozen KL reference: a model in this process (``model``), or the one the
    sharded backend's ranks hold (``backend``), sharded as the policy is."""

    model: Any = None
    backend: Any = None
    micro_batch_tokens: int = 4096
    chunk: int = 0

    def logprobs(self, batch, temperature: float) -> torch.Tensor:
        if self.backend is not None:
            return self.backend.reference_logprobs(batch, temperature)
        from trainers.backends.base import batched_logprobs
        return batched_logprobs(self.model, batch, temperature, self.micro_batch_tokens,
                                chunk=self.chunk)[0]


def reference(cfg: Config, path, backend) -> Reference:
    """Where the reference lives: with a sharded backend (fsdp, deepspeed), in its ranks
    beside the policy; with the single backend, on the policy's device; in host memory
    with ``algo.ref_offload`` (either backend)."""
    from agentgym.device import HOST
    from agentgym.models import load_model
    t = cfg.trainer
    if t.backend != "single" and not cfg.algo.ref_offload:
        return Reference(backend=backend)
    model = load_model(path, dtype=cfg.model.dtype,
                       device=HOST if cfg.algo.ref_offload else t.device).eval()
    model.requires_grad_(False)
    return Reference(model=model, micro_batch_tokens=t.micro_batch_tokens,
                     chunk=t.logprob_chunk)
