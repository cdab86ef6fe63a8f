"""The process group a trainer shares with rollout servers to broadcast weights.

Built the way SGLang builds its side (``init_custom_process_group`` in
``python/sglang/srt/utils``, called by ``/init_weights_update_group``): a TCP rendezvous
at ``tcp://master_address:master_port`` (rank 0, the trainer, hosts the store), the store
prefixed with the group's name, and a process group of its own that is not the default
group, so neither side needs ``init_process_group``. The trainer and ``agentgym serve``
both call :func:`init_weight_group`, and a real SGLang server builds the same group, so
one trainer-side call serves either. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import datetime

import torch


def init_weight_group(backend: str, master_address: str, master_port: int, world_size: int,
                      rank: int, group_name: str, timeout_s: float = 300.0):
    """Join (rank 0: host) the weight-update group; returns the process group."""
    from torch.distributed.distributed_c10d import (PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-update group backend {backend!r}; valid: gloo, nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                              world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], backend,
                                         PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` of a weight-update group."""
    import torch.distributed as dist
    dist.broadcast(tensor, src=src, group=group)


def destroy_weight_group(group) -> None:
    import torch.distributed as dist
    dist.destroy_process_group(group)
