"""Peak memory and time of one policy update as a function of the micro-batch budget.

    python bench/train_memory.py 4096     # run once per budget: peak RSS is per process
    python bench/train_memory.py 8192

One ``SingleBackend.train_step`` of smollm2-135m (bf16 autocast) over 16 synthetic
trajectories of 300 prompt + 700 sampled tokens, GRPO loss; prints peak RSS and seconds.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentgym.config import build_config  # noqa: E402
from agentgym.models.zoo import load_model, resolve_model  # noqa: E402
from agentgym.core.types import Trajectory  # noqa: E402
from agentgym.trainers.backends.single import SingleBackend  # noqa: E402
from agentgym.trainers.batch import collate  # noqa: E402
from agentgym.trainers.phases import make_loss_fn  # noqa: E402


def main() -> None:
    budget = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    model = load_model(resolve_model("smollm2-135m"))
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(16):
        t = Trajectory(uid=str(i // 4), reward=float(i % 2))
        t.append("prompt", torch.randint(5, 40000, (300,), generator=g).tolist(), 0)
        t.append("generated", torch.randint(5, 40000, (700,), generator=g).tolist(), 0,
                 logprobs=[-1.0] * 700)
        trajs.append(t)
    batch = collate(trajs, 0)
    mask = batch.loss_mask
    batch.old_logp = -torch.rand(mask.shape, generator=g) * mask
    batch.adv = torch.randn(16, generator=g)[:, None] * mask
    backend = SingleBackend(model, lr=1e-5, micro_batch_tokens=budget, mixed_precision="bf16")
    t0 = time.time()
    backend.train_step(backend.split(batch),
                       make_loss_fn(build_config({}), 1.0, float(mask.sum()), 16, 768))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"micro_batch_tokens={budget}: peak RSS {peak:.1f} GB, {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
