"""``python tests/cli_with_faults.py train …``: the agentgym CLI with the test toy env
registered, for tests that run training in a subprocess.

Fault injection (tests only): with ``AGENTGYM_TEST_KILL_IN_SAVE=N`` the process sends
itself SIGKILL in the middle of saving checkpoint N: after the backend has written its
weights and optimizer shards into ``step_N.tmp``, before ``state.json`` and the rename
that mark the checkpoint complete. With ``AGENTGYM_TEST_BLOCK_IN_SAVE=N`` saving checkpoint
N blocks forever at the same point instead (``blocked_checkpoint_write``: a write to a disk
that stopped answering). With ``AGENTGYM_TEST_BLOCK_IN_PUSH=N`` pushing policy version N
to the rollout engine blocks forever (``blocked_weight_push``: an engine that stopped
taking weights). With ``AGENTGYM_TEST_SILENT_RANK=R:N`` rank R of a sharded
backend is not sent the N-th ``train_step``: the other ranks enter its collectives and
wait for a rank that stopped answering.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentgym import envs  # noqa: E402
from agentgym.trainers.backends.distributed import DistributedBackend  # noqa: E402
from agentgym.trainers.backends.single import SingleBackend  # noqa: E402

envs.register_env("agentgym-test/Letter-v0", "toy_envs:LetterEnv")

KILL_AT = os.environ.get("AGENTGYM_TEST_KILL_IN_SAVE")
if KILL_AT:
    def dying(save):
        def wrapper(self, path, tokenizer=None):
            save(self, path, tokenizer)
            if Path(path).name == f"step_{KILL_AT}.tmp":
                os.kill(os.getpid(), signal.SIGKILL)
        return wrapper
    SingleBackend.save = dying(SingleBackend.save)
    DistributedBackend.save = dying(DistributedBackend.save)

BLOCK_AT = os.environ.get("AGENTGYM_TEST_BLOCK_IN_SAVE")
if BLOCK_AT:
    import threading

    def blocked_checkpoint_write() -> None:
        threading.Event().wait()

    def blocking(save):
        def wrapper(self, path, tokenizer=None):
            save(self, path, tokenizer)
            if Path(path).name == f"step_{BLOCK_AT}.tmp":
                blocked_checkpoint_write()
        return wrapper
    SingleBackend.save = blocking(SingleBackend.save)

PUSH_AT = os.environ.get("AGENTGYM_TEST_BLOCK_IN_PUSH")
if PUSH_AT:
    import threading

    from agentgym.trainers.workers import LocalWorkers

    def blocked_weight_push() -> None:
        threading.Event().wait()

    def blocking_push(push):
        def wrapper(self, state_dict, version):
            if version == int(PUSH_AT):
                blocked_weight_push()
            push(self, state_dict, version)
        return wrapper
    LocalWorkers.update_weights = blocking_push(LocalWorkers.update_weights)

SILENT = os.environ.get("AGENTGYM_TEST_SILENT_RANK")
if SILENT:
    import pickle

    from agentgym.trainers.backends.distributed import ProcessRanks
    silent_rank, nth = map(int, SILENT.split(":"))
    calls = {"train_step": 0}
    real_call = ProcessRanks.call

    def call_without_one_rank(self, method, args_per_rank):
        if method == "train_step":
            calls[method] += 1
            if calls[method] == nth:
                for r, (conn, args) in enumerate(zip(self.conns, args_per_rank)):
                    if r != silent_rank:
                        conn.send_bytes(pickle.dumps((method, args)))
                return self._gather()
        return real_call(self, method, args_per_rank)
    ProcessRanks.call = call_without_one_rank

if __name__ == "__main__":
    from agentgym.cli import main
    sys.exit(main(sys.argv[1:]))
