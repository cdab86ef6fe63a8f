"""Weight sync from the trainer to SGLang servers (the ``engine.weight_sync`` modes).

Mixed into :class:`agentgym.rollout.engines.sglang.SGLangEngine`, which supplies the transport
(``servers``, ``_call``, ``_each``, ``_post_once``, ``_loop``, ``_with_retries``,
``_server_info``). The route bodies follow SGLang's ``io_struct.py``
(``UpdateWeightFromDiskReqInput``, ``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``UpdateWeightsFromTensorReqInput``).

- ``disk`` (default): the state dict is written once as safetensors into
  ``engine.sync_dir`` (a temporary folder by default; servers on other machines need a
  shared path) and every server loads it (``/update_weights_from_disk``).
- ``distributed``: the trainer (rank 0) forms one process group with every server
  (``/init_weights_update_group``) and broadcasts each tensor while the servers receive
  it (``/update_weights_from_distributed`` with ``names``/``dtypes``/``shapes``): split
  placement without a shared disk. Each SGLang server joins with one rank per
  tensor-parallel worker: ``ModelRunner.init_weights_update_group``
  (``python/sglang/srt/model_executor/model_runner.py``) takes
  ``rank = rank_offset + tp_rank``. So the client reads every server's ``tp_size`` from
  ``/server_info`` (``/get_server_info`` on older servers; the fields are
  ``dataclasses.asdict(ServerArgs)``, ``http_server.py``) and gives server *i* the ranks
  ``1 + sum(tp sizes before it)`` onwards (:func:`weight_group_ranks`). Servers with
  ``pp_size > 1``, or ``dp_size > 1`` without DP attention, have several workers with
  the same ``tp_rank`` and are refused. The backend is NCCL when the tensors handed to
  :meth:`update_weights` are on a GPU, gloo otherwise. **From ``agentgym train`` it is
  always gloo**: the training backends hand the engine CPU state dicts
  (``trainers/backends``), and this client does not move them to a GPU. A real SGLang
  server then receives over gloo into its GPU tensors; that path, and NCCL, never ran
  here (no GPU): only gloo against ``agentgym serve`` is tested.
- ``tensor``: ``/update_weights_from_tensor`` with ``serialized_named_tensors`` made by
  SGLang's ``MultiprocessingSerializer`` (so ``sglang`` must be installed in the
  trainer's environment), one entry per TP rank of each server (SGLang's
  ``TpModelWorker.update_weights_from_tensor`` in ``python/sglang/srt/managers/
  tp_worker.py`` deserializes ``serialized_named_tensors[self.tp_rank]``). The payload
  holds handles, not data: CUDA IPC handles for GPU tensors, shared-memory handles for
  CPU tensors, so servers must run on this machine. From ``agentgym train`` the
  tensors are CPU tensors (see above), so it is shared memory, not CUDA IPC. Never run
  here: ``agentgym serve`` refuses this route.

Tied copies (``lm_head.weight`` with tied embeddings) are never sent: SGLang's model
loaders skip ``lm_head.weight`` when ``tie_word_embeddings`` is set (e.g.
``Qwen2ForCausalLM.load_weights``), so the embedding's value is the one that counts.
Every update carries ``weight_version``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import time
import uuid
from urllib.parse import urlparse

from agentgym.core.device import is_accelerator
from agentgym.rollout.engines.sglang_api import SGLangServerError
from agentgym.supervision.server_process import free_port

logger = logging.getLogger(__name__)


def tied_copies(state_dict: dict) -> dict[str, str]:
    """Names that share storage with an earlier name (tied embeddings: ``lm_head.weight``
    -> ``model.embed_tokens.weight``), each mapped to that earlier name."""
    seen: dict = {}
    tied = {}
    for k, v in state_dict.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) \
            if v.device.type != "meta" else id(v)
        if key in seen:
            tied[k] = seen[key]
        else:
            seen[key] = k
    return tied


def unique_tensors(state_dict: dict) -> dict:
    """The state dict without tied copies, as ``save_pretrained`` writes it; servers
    re-tie them."""
    tied = tied_copies(state_dict)
    return {k: v for k, v in state_dict.items() if k not in tied}


def weight_group_ranks(tp_sizes: list[int]) -> tuple[int, list[int]]:
    """World size and each server's ``rank_offset`` in one weight-update group.

    The trainer is rank 0; server ``i`` holds ranks ``offsets[i] .. offsets[i] +
    tp_sizes[i] - 1`` (SGLang: ``rank = rank_offset + tp_rank``).

    Example: ``weight_group_ranks([2, 4]) == (7, [1, 3])``.
    """
    offsets, next_rank = [], 1
    for tp in tp_sizes:
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor-parallel sizes must be integers >= 1, got {tp_sizes}")
        offsets.append(next_rank)
        next_rank += tp
    return next_rank, offsets


def group_ranks_of(info: dict, url: str) -> int:
    """How many ranks a server takes in a weight-update group (its ``tp_size``), from
    its ``/server_info``; refuses layouts where SGLang's ranks would collide."""
    tp = int(info.get("tp_size") or 1)
    pp = int(info.get("pp_size") or 1)
    dp = int(info.get("dp_size") or 1)
    if pp > 1 or (dp > 1 and not info.get("enable_dp_attention")):
        raise ValueError(f"{url} runs with pp_size={pp}, dp_size={dp}: SGLang's workers "
                         f"join weight-update groups as rank_offset + tp_rank, so several "
                         f"of them would take the same rank; use engine.weight_sync=disk, "
                         f"or one server per data-parallel replica")
    return tp


def tensor_update_body(payload: str, tp_size: int, version: int) -> dict:
    """``/update_weights_from_tensor`` body for a server with ``tp_size`` TP workers:
    each reads ``serialized_named_tensors[tp_rank]``."""
    return {"serialized_named_tensors": [payload] * tp_size, "flush_cache": True,
            "weight_version": str(version)}


class WeightSyncMixin:
    """``update_weights`` for :class:`~agentgym.rollout.engines.sglang.SGLangEngine` (see the
    module docstring for the modes)."""

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Push ``state_dict`` to every server as ``weight_version`` ``str(version)``.

        Raises:
            SGLangServerError: a server refused or could not be reached (named in the
                message); :meth:`resume` afterwards still reopens this client.
        """
        t0 = time.perf_counter()
        tensors = unique_tensors(state_dict)
        try:
            if self.weight_sync == "disk":
                self._sync_disk(tensors, version)
            elif self.weight_sync == "distributed":
                self._sync_distributed(tensors, version)
            else:
                self._sync_tensor(tensors, version)
        except BaseException as e:
            self._failed_update = e  # resume() will not cover it with its own error
            raise
        self._failed_update = None
        self.policy_version = version
        self.weight_version = str(version)
        logger.info("weights v%d (%d tensors) pushed to %d server(s) by %s in %.2fs", version,
                    len(tensors), len(self.servers), self.weight_sync, time.perf_counter() - t0)

    def _check_all(self, answers: list, what: str) -> None:
        for server, ans in zip(self.servers, answers):
            self._check_one(server, ans, what)

    @staticmethod
    def _check_one(server, ans, what: str) -> None:
        if isinstance(ans, dict) and ans.get("success") is False:
            raise SGLangServerError(f"{server.url} refused {what}: {ans.get('message')}",
                                    [server.url])

    def _sync_disk(self, tensors: dict, version: int) -> None:
        from safetensors.torch import save_file
        final = self.sync_dir / f"weights_v{version}"
        tmp = self.sync_dir / f".weights_v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        body = {"model_path": str(final.resolve()), "weight_version": str(version),
                "flush_cache": True}
        answers = self._call(self._each("/update_weights_from_disk", body))
        self._check_all(answers, "update_weights_from_disk")
        for old in self.sync_dir.glob("weights_v*"):  # servers hold the new version now
            if old != final:
                shutil.rmtree(old, ignore_errors=True)

    def _address(self) -> str:
        if self.sync_address:
            return self.sync_address
        hosts = {urlparse(s.url).hostname for s in self.servers}
        if hosts <= {"127.0.0.1", "localhost", "::1"}:
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())

    def _tp_sizes(self) -> list[int]:
        """Each server's tensor-parallel size, from its ``/server_info``."""
        async def all_infos():
            return await asyncio.gather(*(self._with_retries(
                lambda k, s=s: self._server_info(s), f"{s.url}/server_info")
                for s in self.servers))
        infos = self._call(all_infos())
        return [group_ranks_of(info, s.url) for s, info in zip(self.servers, infos)]

    def _init_group(self, backend: str) -> None:
        from agentgym.rollout.engines.weight_group import init_weight_group  # lazy: loads torch
        world, offsets = weight_group_ranks(self._tp_sizes())
        host, port = self._address(), free_port()
        futs = [asyncio.run_coroutine_threadsafe(self._post_once(
            s, "/init_weights_update_group",
            {"master_address": host, "master_port": port, "rank_offset": off,
             "world_size": world, "group_name": self._group_name, "backend": backend}),
            self._loop) for s, off in zip(self.servers, offsets)]
        self._group = init_weight_group(backend, host, port, world, 0, self._group_name)
        self._check_all([f.result() for f in futs], "init_weights_update_group")

    def _sync_distributed(self, tensors: dict, version: int) -> None:
        import torch

        from agentgym.rollout.engines.weight_group import broadcast  # lazy: loads torch
        try:
            if self._group is None:
                self._init_group("nccl" if any(is_accelerator(v.device) for v in tensors.values())
                                 else "gloo")
            names = list(tensors)
            body = {"names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.")
                                               for n in names],
                    "shapes": [list(tensors[n].shape) for n in names],
                    "group_name": self._group_name, "flush_cache": True,
                    "weight_version": str(version)}
            futs = [asyncio.run_coroutine_threadsafe(
                self._post_once(s, "/update_weights_from_distributed", body), self._loop)
                for s in self.servers]
            with torch.no_grad():  # the servers receive in `names` order
                for n in names:
                    broadcast(self._group, tensors[n].detach().contiguous())
            self._check_all([f.result() for f in futs], "update_weights_from_distributed")
        except BaseException:
            self._drop_group()  # its state is unknown; the next update builds a new one
            raise

    def _sync_tensor(self, tensors: dict, version: int) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as e:
            raise RuntimeError("engine.weight_sync=tensor sends tensor handles made by "
                               "SGLang's MultiprocessingSerializer, so sglang must be "
                               "installed here and the servers run on this machine; use "
                               "engine.weight_sync=disk or distributed otherwise") from e
        sizes = dict(zip((s.url for s in self.servers), self._tp_sizes()))
        payload = MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True)
        answers = self._call(self._each(
            "/update_weights_from_tensor",
            lambda s: tensor_update_body(payload, sizes[s.url], version)))
        self._check_all(answers, "update_weights_from_tensor")

    def _drop_group(self) -> None:
        """Leave the distributed-sync group on every server and here (best effort)."""
        if self._group is None:
            return
        group, self._group = self._group, None
        name, self._group_name = self._group_name, f"agentgym_{uuid.uuid4().hex[:8]}"
        try:
            self._call(self._each("/destroy_weights_update_group", {"group_name": name},
                                  retry=False), timeout=10)
        except Exception as e:  # noqa: BLE001 - a dead server holds no group
            logger.warning("destroy_weights_update_group: %s", e)
        try:
            # lazy: loads torch
            from agentgym.rollout.engines.weight_group import destroy_weight_group
            destroy_weight_group(group)
        except Exception as e:  # noqa: BLE001
            logger.warning("leaving the weight-update group: %s", e)
