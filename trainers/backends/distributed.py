"""Sharded training (``trainer.backend=fsdp|deepspeed``, ``trainer.nprocs=N``) behind the
same protocol as :class:`~agentgym.trainers.backends.single.SingleBackend`.

The recipe's process is the driver and holds no trained weights. It starts N rank
processes that form one process group (gloo on CPU, NCCL on GPU, chosen by whether the
machine has CUDA) and each build their shard of the model
(:mod:`agentgym.trainers.backends.ranks`). Every backend call becomes one call on every rank:

* ``train_step(micro_batches, loss_fn)``: the mini-batch's micro-batches (already cut to
  the token budget by :meth:`split`) are dealt to ranks, largest first to the least
  loaded; every rank gets the same count (``None`` = a zero-weight dummy), runs its
  forward/backward passes, and the optimizer steps once; the ranks' additive metrics
  are summed (``*_max`` ones maxed).
* ``apply(fn, batch)`` / ``logprobs``: micro-batches dealt the same way, outputs put
  back in the batch's row order.
* ``state_dict()``: the full weights, gathered on rank 0 and sent to the driver (weight
  sync into the rollout engine, once per step).
* ``save(dir)`` / ``load(dir)``: each rank writes its shards (FSDP2 through
  ``torch.distributed.checkpoint``, DeepSpeed through ``save_checkpoint``), and rank 0
  the full HF weights, so a checkpoint both resumes the run and loads in transformers.

Without Ray, the ranks are processes started as ``python -m agentgym.trainers.backends.distributed``
(like torchrun's workers, so a user's script is never re-imported) that connect back
to the driver over an authenticated loopback socket (pickled bytes). They die with the
driver (``PR_SET_PDEATHSIG``), so a killed run leaves no rank behind holding memory or
the rendezvous port.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

import torch

from agentgym.supervision.watchdog import (StageStalled, add_stall_hook, collect_stacks,
                                     remove_stall_hook, stacks_on_signal)
from agentgym.trainers.backends.base import LogprobFn, LossFn, ModelSpec
from agentgym.trainers.balancing import split
from agentgym.trainers.backends.ranks import OptimSpec, RANK_BACKENDS
from agentgym.trainers.batch import Batch
from agentgym.core.device import HOST, cuda_available
from agentgym.core.paths import cache_dir

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the kernel sends SIGKILL to this process when its parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def init_rank(rank: int, world: int, addr: str, port: int, kind: str, threads: int) -> None:
    """Process-group set-up of one rank (also used by Ray actors)."""
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)))
    if not cuda_available():
        os.environ.setdefault("DS_ACCELERATOR", HOST)
        torch.set_num_threads(threads)
    backend = "nccl" if cuda_available() else "gloo"
    if kind == "deepspeed":
        # DeepSpeed builds its CPU shared-memory op on first use, under a lock file that a
        # process killed mid-build leaves behind (every later build then waits on it for
        # ever). One build folder per install: two installs sharing torch's default folder
        # rebuilt the op each time they alternated, widening that window (seen here).
        import hashlib
        import sys

        tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions" / tag))
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend)
    else:
        import torch.distributed as dist
        dist.init_process_group(backend, rank=rank, world_size=world)


def serve(conn, rank: int, world: int, port: int, kind: str, spec: ModelSpec,
          optim: OptimSpec, threads: int) -> None:
    """A rank process: build the shard, then answer the driver's calls until told to stop."""

    def reply(status: str, payload: Any) -> None:
        conn.send_bytes(pickle.dumps((status, payload), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        init_rank(rank, world, "127.0.0.1", port, kind, threads)
        backend = RANK_BACKENDS[kind](spec, optim, rank, world)
        reply("ok", None)
    except BaseException:  # noqa: BLE001 - the driver reports it
        reply("error", traceback.format_exc())
        return
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver went away
            break
        if method == "close":
            break
        try:
            reply("ok", getattr(backend, method)(*args))
        except BaseException:  # noqa: BLE001
            reply("error", traceback.format_exc())
    try:
        import torch.distributed as dist
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def stacks_dir() -> Path:
    """A folder for the ranks' stack dumps (processes or Ray actors), named by this
    process; those of drivers that are gone (a SIGKILLed run cannot remove its own) are removed first."""
    for old in Path(tempfile.gettempdir()).glob("agentgym-rank-stacks-*-*"):
        pid = old.name.split("-")[3]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"agentgym-rank-stacks-{os.getpid()}-"))


class ProcessRanks:
    """N rank processes, started as ``python -m agentgym.trainers.backends.distributed`` (as
    torchrun starts its workers: the driver's ``__main__`` is never re-imported) and
    connected back to the driver over an authenticated loopback socket."""

    def __init__(self, n: int, kind: str, spec: ModelSpec, optim: OptimSpec,
                 start_timeout_s: float = 1800.0) -> None:
        key = os.urandom(16)
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // n)
        env = {**os.environ, "AGENTGYM_RANK_AUTHKEY": key.hex(),
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        self.conns, self.procs = [], []
        # each rank dumps its threads' stacks here on SIGUSR2 (a stall: stall_stacks)
        self._stacks = stacks_dir()
        env["AGENTGYM_RANK_STACKS"] = str(self._stacks)
        self._answered: set[int] = set()
        add_stall_hook(self.stall_stacks)
        with Listener(("127.0.0.1", 0), authkey=key) as listener:
            host, lport = listener.address
            for r in range(n):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "agentgym.trainers.backends.distributed",
                     f"{host}:{lport}", str(r)], env=env))
            listener._listener._socket.settimeout(start_timeout_s)
            accepted = {}
            for _ in range(n):
                try:
                    conn = listener.accept()
                except (socket.timeout, OSError) as e:
                    self.close(force=True)
                    raise RuntimeError(f"{kind} ranks did not connect: {e}") from e
                accepted[conn.recv()] = conn  # each rank says which it is
            self.conns = [accepted[r] for r in range(n)]
        for conn in self.conns:
            conn.send((n, port, kind, spec, optim, threads))
        self._gather(timeout_s=start_timeout_s)  # (first DeepSpeed runs JIT-build ops)
        logger.info("%d %s ranks up (port %d, %d threads each)", n, kind, port, threads)

    def call(self, method: str, args_per_rank: list[tuple]) -> list[Any]:
        for conn, args in zip(self.conns, args_per_rank):
            conn.send_bytes(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        return self._gather()

    def stall_stacks(self, path: Path) -> None:
        """A stall's hook (:func:`agentgym.supervision.watchdog.add_stall_hook`): each live rank's
        threads' stacks (faulthandler's, on SIGUSR2), appended to ``path`` under a line
        saying whether the rank answered the call in flight."""
        collect_stacks(path, [
            (f"rank {r}", p.pid, self._stacks / f"rank{r}.txt",
             f"{'answered' if r in self._answered else 'did not answer'} the call in flight")
            for r, p in enumerate(self.procs)])

    def _gather(self, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply; a rank's error or death stops all ranks and raises. A stall
        (:class:`~agentgym.supervision.watchdog.StageStalled`) stops them too, naming the ranks
        that had not answered."""
        try:
            return self._gather_replies(timeout_s)
        except StageStalled as e:
            host = socket.gethostname()
            silent = [f"rank {r} (pid {p.pid} on {host})" for r, p in enumerate(self.procs)
                      if r not in self._answered]
            self.close(force=True)
            raise e.with_detail(f"{', '.join(silent) or 'no rank'} had not answered; every "
                                f"rank was stopped") from None

    def _gather_replies(self, timeout_s: float | None) -> list[Any]:
        results: dict[int, Any] = {}
        self._answered = set()
        start = time.monotonic()
        while len(results) < len(self.conns):
            for r, (conn, p) in enumerate(zip(self.conns, self.procs)):
                if r in results:
                    continue
                if conn.poll(0.05):
                    try:
                        status, payload = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, payload = "error", f"connection closed (exit code {p.poll()})"
                    if status == "error":
                        self.close(force=True)
                        raise RuntimeError(f"rank {r} failed:\n{payload}")
                    results[r] = payload
                    self._answered.add(r)
                elif p.poll() is not None:
                    self.close(force=True)
                    raise RuntimeError(f"rank {r} exited with code {p.returncode}")
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                self.close(force=True)
                raise TimeoutError(f"ranks did not answer within {timeout_s:.0f}s")
        return [results[r] for r in range(len(self.conns))]

    def close(self, force: bool = False) -> None:
        for conn, p in zip(self.conns, self.procs):
            if not force and p.poll() is None:
                try:
                    conn.send_bytes(pickle.dumps(("close", ())))
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=0.1 if force else 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        remove_stall_hook(self.stall_stacks)
        shutil.rmtree(self._stacks, ignore_errors=True)


def _rank_main(address: str, rank: int) -> None:
    """Entry point of a rank process: connect to the driver, learn the job, serve it."""
    import warnings
    _die_with_parent()
    # DeepSpeed 0.19 calls collectives torch 2.13 deprecated; one warning per call
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    if stacks := os.environ.get("AGENTGYM_RANK_STACKS"):  # a stall's report (stall_stacks)
        stacks_on_signal(Path(stacks) / f"rank{rank}.txt")
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["AGENTGYM_RANK_AUTHKEY"]))
    conn.send(rank)
    world, pg_port, kind, spec, optim, threads = conn.recv()
    serve(conn, rank, world, pg_port, kind, spec, optim, threads)


def dummy_like(batch: Batch) -> Batch:
    """A one-row, two-token batch with nothing to learn (mask 0): what a rank with fewer
    micro-batches runs to join the collectives of a step."""
    one = batch.select([0])
    width = min(2, one.input_ids.shape[1])
    out = one.map_tensors(lambda t: (t[:, :width] if t.dim() == 2 else t).clone().zero_())
    out.attention_mask.fill_(1)
    out.input_ids, out.truncated = one.input_ids[:, :width].clone(), one.truncated.clone()
    out.images = out.episodes = out.turn_ids = None
    return out


class DistributedBackend:
    """The driver's handle on N ranks of FSDP2 or DeepSpeed (see the module docstring).

    Args:
        kind: ``fsdp`` or ``deepspeed``.
        spec: the model every rank loads.
        optim: optimizer, schedule and sharding options.
        nprocs: ranks on this machine (``trainer.nprocs``).
        micro_batch_tokens: padded-token budget of one forward/backward on a rank.
        ranks: an already started set of ranks (Ray actors); default: spawn processes.
    """

    def __init__(self, kind: str, spec: ModelSpec, optim: OptimSpec, nprocs: int,
                 micro_batch_tokens: int, ranks=None, logprob_chunk: int = 0,
                 packing: bool = True) -> None:
        self.kind, self.n = kind, nprocs
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk = logprob_chunk
        self.packing = packing
        self.ranks = ranks or ProcessRanks(nprocs, kind, spec, optim)

    def split(self, batch: Batch) -> list[Batch]:
        """Micro-batches; with packing, a multiple of the ranks, balanced by real tokens
        (no rank idles on a dummy while another trains)."""
        return [batch.select(ix) for ix in
                split(batch, self.micro_batch_tokens, self.packing, self.n)]

    def _deal(self, micro: list[Batch]) -> tuple[list[list[Batch | None]], list[list[int]]]:
        """Micro-batches to ranks, largest first to the least loaded; every rank's list
        padded with ``None`` to the same length. Returns the lists and, per rank, the
        index (into ``micro``) of each entry (-1 for padding)."""
        load = [0] * self.n
        where: list[list[int]] = [[] for _ in range(self.n)]
        cost = [int(m.attention_mask.sum()) if self.packing else m.input_ids.numel()
                for m in micro]
        for i in sorted(range(len(micro)), key=lambda i: -cost[i]):
            r = min(range(self.n), key=lambda r: (load[r], len(where[r])))
            where[r].append(i)
            load[r] += cost[i]
        width = max(len(w) for w in where)
        for w in where:
            w += [-1] * (width - len(w))
        return [[micro[i] if i >= 0 else None for i in w] for w in where], where

    def train_step(self, batches: list[Batch], loss_fn: LossFn,
                   lr_scale: float = 1.0) -> dict[str, float]:
        parts, _ = self._deal(batches)
        dummy = dummy_like(batches[0])
        results = self.ranks.call("train_step", [(p, loss_fn, dummy, lr_scale) for p in parts])
        out: dict[str, float] = {}
        for res in results:
            for k, v in res.items():
                if k in ("grad_norm", "lr"):
                    out[k] = v  # the same on every rank
                elif k.endswith("_max"):
                    out[k] = max(out.get(k, v), v)
                else:
                    out[k] = out.get(k, 0.0) + v
        return out

    def apply(self, fn, batch: Batch, model="policy") -> list[torch.Tensor]:
        """``fn(model, micro_batch, device)`` over the batch on all ranks, no grad; the
        outputs (``(b, t)`` padded to the batch width, or ``(b,)``) in row order.
        ``model="reference"``: on the frozen KL reference the ranks hold, sharded as the
        policy is (loaded on first use)."""
        index = split(batch, self.micro_batch_tokens, self.packing, self.n)
        micro = [batch.select(ix) for ix in index]
        parts, where = self._deal(micro)
        outs = self.ranks.call("apply", [(fn, p, dummy_like(batch), model) for p in parts])
        B, width = batch.input_ids.shape
        result: list[torch.Tensor] | None = None
        for r in range(self.n):
            for j, i in enumerate(where[r]):
                if i < 0:
                    continue
                rows = torch.tensor(index[i])
                for k, t in enumerate(outs[r][j]):
                    if result is None:
                        result = [None] * len(outs[r][j])  # type: ignore[list-item]
                    if result[k] is None:
                        shape = (B,) if t.dim() == 1 else (B, width)
                        result[k] = torch.zeros(shape, dtype=t.dtype)
                    if t.dim() == 1:
                        result[k][rows] = t
                    else:
                        result[k][rows, :t.shape[1]] = t
        return result or []

    def logprobs(self, batch: Batch, temperature: float, with_entropy: bool = False):
        out = self.apply(LogprobFn(temperature, with_entropy, self.logprob_chunk, self.packing), batch)
        return out[0], (out[1] if with_entropy else None)

    def reference_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        """The frozen reference's logprobs, computed in the ranks (``algo.kl_coef`` > 0
        without ``algo.ref_offload``)."""
        return self.apply(LogprobFn(temperature, False, self.logprob_chunk, self.packing), batch,
                          model="reference")[0]

    def teacher_logprobs(self, batch: Batch, temperature: float, spec) -> torch.Tensor:
        """On-policy distillation's teacher's logprobs (``spec``: its ModelSpec), computed
        in the ranks, where it is sharded as the policy is (loaded on first use)."""
        return self.apply(LogprobFn(temperature, False, self.logprob_chunk, self.packing), batch,
                          model=spec)[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (gathered on rank 0), for weight sync and HF export."""
        return self.ranks.call("full_state_dict", [()] * self.n)[0]

    def save(self, path: str | os.PathLike, tokenizer=None) -> None:
        """Sharded training state from every rank and HF weights from rank 0."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.ranks.call("save", [(str(path),)] * self.n)
        self.ranks.call("export_hf", [(str(path),)] * self.n)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def load(self, path: str | os.PathLike) -> None:
        self.ranks.call("load", [(str(path),)] * self.n)

    def close(self) -> None:
        self.ranks.close()


if __name__ == "__main__":
    from agentgym.core.memory import return_freed_memory
    return_freed_memory()
    _rank_main(sys.argv[1], int(sys.argv[2]))
