"""Ray orchestration (``ray.address=local|auto|host:port``): rollout workers and train
ranks as actors, placed ``colocated`` or ``split``.

    agentgym train env=search ray.address=local ray.rollout_workers=2
    agentgym train env=search ray.address=auto backend=fsdp trainer.nprocs=4 placement=split

What runs where:

* **Rollout workers** (``ray.rollout_workers`` actors): each holds an engine with its own
  copy of the policy, a generation manager and its envs (tools such as a local
  retriever start on the worker's node). The driver deals whole prompts to workers, so
  a prompt's group stays together, and gets the trajectories back in order. A
  trajectory's sampling seed depends on (``trainer.seed``, step, prompt, sample) only,
  so which worker plays a prompt does not change what it samples.
* **Train ranks**: with a sharded backend (``backend=fsdp|deepspeed``) the
  ``trainer.nprocs`` ranks are actors that form the process group (rank 0's node gives
  the rendezvous address) and hold the same per-rank backends as the process launcher
  (:mod:`agentgym.trainers.backends.ranks`); PPO's critic gets its own ranks beside them. With
  ``backend=single`` the trainer stays in the driver.
* **Placement**: resources come from placement groups of bundles of ``ray.cpus`` CPUs
  and ``ray.gpus`` GPUs. ``split``: one group for the train ranks, another for the
  rollout workers, so they never share a bundle (on a cluster they land on different
  nodes when one node cannot hold both). ``colocated``: one group; rollout worker ``i``
  shares bundle ``i`` with train rank ``i``, each actor taking an equal share of it.
* **Weight sync**, after every step: the full state dict is gathered once (on rank 0,
  or the single backend in the driver), put in the object store once, and every worker
  loads that one object, stamped with the policy version, generation paused around the
  swap.

Without ``ray.address`` none of this is imported: one process, or ``trainer.nprocs``
rank processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from agentgym.config import Config
from agentgym.supervision.watchdog import (StageStalled, add_stall_hook, collect_stacks,
                                    remove_stall_hook, stacks_on_signal)
from agentgym.models.zoo import load_tokenizer
from agentgym.supervision import stalls
from agentgym.trainers.hooks import Hooks
from agentgym.core.paths import cache_dir

logger = logging.getLogger(__name__)

_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM",
             "AGENTGYM_CACHE", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")


def _gather(refs: list, actors: list, what: str, names: list[str] | None = None) -> list:
    """``ray.get`` of every ref; the first failure kills ``actors`` (the others may be
    waiting in a collective for it) and is re-raised with the remote traceback. A stall of
    the stage that waits (:class:`~agentgym.supervision.watchdog.StageStalled`, which a one-second
    Ray wait lets the signal handler raise, then reports as a SystemError) kills them too,
    naming (``names``, one per ref) those that had not answered."""
    import ray
    pending, done = list(refs), {}
    index = {r: i for i, r in enumerate(refs)}
    try:
        while pending:
            # in slices: a wait with no timeout never lets the stall's signal handler run
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    done[index[ref]] = ray.get(ref)
                except Exception:
                    for a in actors:
                        ray.kill(a)
                    logger.error("%s failed; its actors were stopped", what)
                    raise
    except BaseException as e:  # a stall's signal in Ray's wait surfaces as a SystemError
        stall = e if isinstance(e, StageStalled) else e.__context__
        if not isinstance(stall, StageStalled):
            raise
        silent = [names[i] if names else f"actor {i}" for i in range(len(refs)) if i not in done]
        for a in actors:
            ray.kill(a)
        raise stall.with_detail(f"{', '.join(silent)} had not answered; every actor of the "
                                f"{what} was stopped") from None
    return [done[i] for i in range(len(refs))]


class RankActor:
    """A train rank as a Ray actor: the same per-rank backend as a rank process."""

    def address(self) -> tuple[str, int]:
        import ray

        from agentgym.trainers.backends.distributed import free_port  # lazy: loads torch
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, rank: int, world: int, addr: str, port: int, kind: str, spec, optim,
              threads: int, driver_host: str, stacks: str) -> tuple[str, int, str]:
        """The rank's process group and backend; its node, pid and host. On the driver's
        host, its stacks go to ``stacks`` when the driver's stage stalls (SIGUSR2)."""
        import ray

        from agentgym.trainers.backends.distributed import init_rank  # lazy: loads torch
        from agentgym.trainers.backends.ranks import RANK_BACKENDS  # lazy: loads torch
        host = socket.gethostname()
        if host == driver_host:
            stacks_on_signal(stacks)
        os.environ["LOCAL_RANK"] = "0"  # Ray gives each actor its own visible GPU(s)
        init_rank(rank, world, addr, port, kind, threads)
        self.backend = RANK_BACKENDS[kind](spec, optim, rank, world)
        return ray.get_runtime_context().get_node_id(), os.getpid(), host

    def call(self, method: str, *args) -> Any:
        return getattr(self.backend, method)(*args)


class RolloutWorker:
    """A rollout worker as a Ray actor: an engine, a generation manager and its envs."""

    def __init__(self, cfg: Config, path: str) -> None:
        from agentgym.rollout.runtime import engine_for  # lazy: loads httpx
        from agentgym.trainers.workers import LocalWorkers  # lazy: loads httpx
        tokenizer = load_tokenizer(path)
        self.local = LocalWorkers(cfg, engine_for(cfg, path, tokenizer), tokenizer)

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def generate(self, rows: list[dict], n: int, seed: int, greedy: bool) -> tuple:
        """The trajectories, with the stalls since the last call (:func:`_stalled`)."""
        return _stalled(lambda: self.local.generate(rows, n, seed, Hooks(), greedy))

    def run_group(self, row: dict, uid: str, n: int, seed: int) -> tuple:
        """One prompt group for asynchronous training (runs in one of the actor's threads,
        next to others and to weight updates), as :meth:`generate` returns it."""
        import asyncio
        return _stalled(lambda: asyncio.run(self.local.run_group(row, uid, n, seed)))

    def update_weights(self, state_dict: dict, version: int) -> int:
        self.local.update_weights(state_dict, version)
        return version

    def close(self) -> None:
        self.local.close()


def _stalled(play) -> tuple[list, list, Exception | None]:
    """``(trajectories, cuts, ended)`` of ``play()`` on a rollout worker: the episodes its
    stalls cut since the last call (:meth:`agentgym.supervision.stalls.StallLedger.take`, each
    site's first with its stacks), which the driver writes into its run's ``stalls/``; and
    the error that ends the run when one site kept hanging there (None: it did not)."""
    try:
        trajs, ended = play(), None
    except stalls.StallsEndRun as e:
        trajs, ended = [], e
    return trajs, stalls.ledger().take(), ended


def _merged(i: int, answer: tuple) -> list:
    """A rollout worker's answer (:func:`_stalled`): its cuts into the driver's
    ``stalls/``, the run ended if it says so; its trajectories."""
    trajs, cuts, ended = answer
    ledger = stalls.ledger()
    ledger.merge(cuts)
    if ended is not None:
        raise ledger.adopt(ended, f"on rollout worker {i}")
    return trajs


class RayCluster:
    """The Ray connection and the placement groups of one training run."""

    def __init__(self, cfg: Config) -> None:
        import ray
        from ray.util.placement_group import placement_group

        r, t = cfg.ray, cfg.trainer
        self.owns_connection = not ray.is_initialized()
        if self.owns_connection:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            env = {k: os.environ[k] for k in _ENV_VARS if k in os.environ}
            kw: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": True}
            if r.address == "local":
                # our actors are the run's work (rollouts, train ranks), not background
                # helpers: Ray's default worker niceness (15) starves them on a busy machine
                os.environ.setdefault("RAY_worker_niceness", "0")
                ray.init(include_dashboard=False, _temp_dir=str(cache_dir() / "ray"), **kw)
            else:
                ray.init(address=r.address, **kw)
        sharded = t.backend != "single"
        n_train = t.nprocs if sharded else 0
        train_actors = 1 + (sharded and cfg.algo.needs_critic)  # per train bundle
        bundle = {"CPU": r.cpus, **({"GPU": r.gpus} if r.gpus else {})}
        self.bundle = bundle
        if r.placement == "split" or not n_train:
            self.train_pg = placement_group([bundle] * n_train, strategy="PACK") if n_train else None
            self.rollout_pg = placement_group([bundle] * r.rollout_workers, strategy="PACK")
            self.shares = {"train": 1 / train_actors, "rollout": 1.0}
        else:
            self.train_pg = self.rollout_pg = placement_group(
                [bundle] * max(n_train, r.rollout_workers), strategy="PACK")
            share = 1 / (train_actors + 1)
            self.shares = {"train": share, "rollout": share}
        groups = [g for g in {id(self.train_pg): self.train_pg,
                              id(self.rollout_pg): self.rollout_pg}.values() if g is not None]
        try:
            ray.get([g.ready() for g in groups], timeout=120)
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(
                f"the Ray cluster cannot place {n_train} train rank(s) and {r.rollout_workers} "
                f"rollout worker(s) in bundles of {bundle} with placement={r.placement}; it has "
                f"{ray.cluster_resources()}; lower ray.cpus / ray.gpus or add nodes") from e
        self.nodes: dict[str, list[str]] = {}
        logger.info("Ray placement %s: %d train bundle(s), %d rollout worker(s) of %s",
                    r.placement, n_train, r.rollout_workers, bundle)

    def options(self, role: str, index: int) -> dict[str, Any]:
        """Actor options: bundle ``index`` of the role's placement group, its share."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        pg = self.train_pg if role == "train" else self.rollout_pg
        share = self.shares[role]
        return {"num_cpus": self.bundle["CPU"] * share,
                "num_gpus": self.bundle.get("GPU", 0.0) * share,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=index % pg.bundle_count)}

    def threads(self, role: str) -> int:
        return max(1, int(self.bundle["CPU"] * self.shares[role]))

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        for g in {id(self.train_pg): self.train_pg, id(self.rollout_pg): self.rollout_pg}.values():
            if g is not None:
                remove_placement_group(g)
        if self.owns_connection:
            ray.shutdown()


class RayRanks:
    """``trainer.nprocs`` train ranks as actors: the ``call`` interface of
    :class:`agentgym.trainers.backends.distributed.ProcessRanks`. A stall of the stage
    that waits for them names the ranks that had not answered (rank, pid, host) and stops
    every one; the stall's file gets the stacks of those on the driver's host."""

    def __init__(self, cluster: RayCluster, n: int, kind: str, spec, optim, role: str) -> None:
        import ray

        from agentgym.trainers.backends.distributed import stacks_dir  # lazy: loads torch
        cls = ray.remote(RankActor)
        self.actors = [cls.options(**cluster.options("train", r), name=None).remote()
                       for r in range(n)]
        addr, port = ray.get(self.actors[0].address.remote())
        threads = cluster.threads("train")
        self._stacks = stacks_dir()
        here = socket.gethostname()
        setups = [a.setup.remote(r, n, addr, port, kind, spec, optim, threads, here,
                                 str(self._stacks / f"rank{r}.txt"))
                  for r, a in enumerate(self.actors)]
        where = _gather(setups, self.actors, f"{role} ranks")
        self.nodes = [node for node, _, _ in where]
        self.where = [(pid, host) for _, pid, host in where]
        self.names = [f"rank {r} (pid {pid} on {host})" for r, (pid, host) in enumerate(self.where)]
        cluster.nodes[f"{role}_ranks"] = self.nodes
        add_stall_hook(self.stall_stacks)
        logger.info("%d %s %s ranks on nodes %s", n, kind, role, self.nodes)

    def call(self, method: str, args_per_rank: list[tuple]) -> list[Any]:
        return _gather([a.call.remote(method, *args) for a, args in zip(self.actors, args_per_rank)],
                       self.actors, method, self.names)

    def stall_stacks(self, path: Path) -> None:
        """A stall's hook: the stacks of the ranks on this host (faulthandler's, SIGUSR2)."""
        here = socket.gethostname()
        collect_stacks(path, [(f"rank {r}", pid if host == here else None,
                               self._stacks / f"rank{r}.txt", "" if host == here else
                               f"a Ray actor on {host}")
                              for r, (pid, host) in enumerate(self.where)])

    def close(self) -> None:
        import ray
        remove_stall_hook(self.stall_stacks)
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        shutil.rmtree(self._stacks, ignore_errors=True)


class RayWorkers:
    """Episodes played on ``ray.rollout_workers`` actors, with
    :class:`~agentgym.trainers.workers.LocalWorkers`'s
    interface (``generate``, ``update_weights``, ``close``).

    A worker that dies during :meth:`generate` (its process killed, its node lost) is
    replaced: a new actor in the same placement bundle, loaded with the last weights pushed,
    is given the dead one's prompts with the same seed (so the step's trajectories are the
    ones it would have had). Each replacement is logged at WARNING and counted in
    ``infra/restarts``; more than ``MAX_REPLACEMENTS`` in one call raise.
    """

    MAX_REPLACEMENTS = 3

    def __init__(self, cluster: RayCluster, cfg: Config, path: str) -> None:
        import ray
        self.cluster, self.cfg, self.path = cluster, cfg, path
        self._cls = ray.remote(RolloutWorker)
        # asynchronous training: groups run in the actor's threads while weights update
        self._threads = {"max_concurrency": 256} if cfg.trainer.mode == "async" else {}
        self.workers = [self._spawn(i) for i in range(cfg.ray.rollout_workers)]
        self.in_flight = [0] * len(self.workers)
        self._weights: tuple[Any, int] | None = None  # the last push: what a replacement loads
        cluster.nodes["rollout_workers"] = _gather([w.node.remote() for w in self.workers],
                                                   self.workers, "rollout workers")
        logger.info("rollout workers on nodes %s", cluster.nodes["rollout_workers"])

    def _spawn(self, i: int):
        return self._cls.options(**self.cluster.options("rollout", i),
                                 **self._threads).remote(self.cfg, self.path)

    def _replace(self, i: int, error: Exception) -> None:
        """Worker ``i`` died: start another in its bundle, with the last weights pushed."""
        import ray
        from agentgym.supervision.supervisor import outage_for  # lazy: loads httpx
        version = self._weights[1] if self._weights else 0
        logger.warning("rollout worker %d died (%s); replacing it (weights of policy version "
                       "%d) and giving it the same prompts", i, str(error).splitlines()[0],
                       version)
        ray.kill(self.workers[i])
        worker = self._spawn(i)
        if self._weights is not None:
            ray.get(worker.update_weights.remote(*self._weights))
        self.workers[i] = worker
        outage_for(f"ray://rollout-worker-{i}").restarts += 1

    def generate(self, rows: list[dict], n: int, seed: int, hooks, greedy: bool = False) -> list:
        """Whole prompts dealt to workers in contiguous chunks; trajectories in row order."""
        import ray
        from ray.exceptions import RayActorError
        rows = [_with_uid(row, i) for i, row in enumerate(rows)]
        k = len(self.workers)
        chunks = [rows[i * len(rows) // k:(i + 1) * len(rows) // k] for i in range(k)]
        hooks.phase("rollout", len(rows) * (1 if greedy else n))
        owner = {self.workers[i].generate.remote(c, n, seed, greedy): i
                 for i, c in enumerate(chunks) if c}
        out: dict[int, list] = {}
        pending, replaced = list(owner), 0
        while pending:
            # in slices: a wait with no timeout never lets the stall's signal handler run
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                i = owner[ref]
                try:
                    out[i] = _merged(i, ray.get(ref))
                except RayActorError as e:
                    replaced += 1
                    if replaced > self.MAX_REPLACEMENTS:
                        raise
                    self._replace(i, e)
                    again = self.workers[i].generate.remote(chunks[i], n, seed, greedy)
                    owner[again] = i
                    pending.append(again)
                    continue
                hooks.advance(len(out[i]))
        return [t for i in sorted(out) for t in out[i]]

    async def run_group(self, row: dict, uid: str, n: int, seed: int) -> list:
        """One prompt group on the worker with the fewest groups in flight."""
        i = min(range(len(self.workers)), key=lambda j: self.in_flight[j])
        self.in_flight[i] += 1
        try:
            return _merged(i, await self.workers[i].run_group.remote(row, uid, n, seed))
        finally:
            self.in_flight[i] -= 1

    def update_weights(self, state_dict: dict, version: int) -> None:
        import ray
        ref = ray.put(state_dict)  # once; every worker reads the same object
        _gather([w.update_weights.remote(ref, version) for w in self.workers], self.workers,
                "weight sync")
        self._weights = (ref, version)  # kept (one copy in the object store) for replacements

    def close(self) -> None:
        import ray
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def _with_uid(row: dict, i: int) -> dict:
    """A row that names its own group id (``extra_info.index``), so a worker's local
    position does not become the prompt's id."""
    extra = row.get("extra_info") or {}
    if extra.get("id") is not None or extra.get("index") is not None:
        return row
    return {**row, "extra_info": {**extra, "index": i}}
