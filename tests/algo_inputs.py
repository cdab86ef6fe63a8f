"""Inputs shared by the RL math tests (tests/test_algos.py, tests/test_policy_losses.py)."""

from __future__ import annotations

import torch


def random_multi_turn(seed: int, B: int = 6, T: int = 24):
    """A random multi-turn batch: each row a prompt, then turns of sampled tokens (mask 1)
    with the turn's reward on its last token, separated by observations (mask 0).

    Returns:
        ``(rewards, mask, values, last_values, truncated, groups)``: ``(B, T)``, ``(B, T)``,
        ``(B, T)``, ``(B,)``, ``(B,)`` bool, and ``B`` group ids (three rows a group).
    """
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    rewards = torch.zeros(B, T)
    for b in range(B):
        pos = int(torch.randint(1, 4, (1,), generator=g))  # prompt
        while pos < T - 1:
            n = int(torch.randint(1, 5, (1,), generator=g))
            mask[b, pos:pos + n] = 1  # a turn's sampled tokens ...
            last = min(pos + n, T) - 1
            rewards[b, last] = float(torch.randn(1, generator=g))  # ... its reward at its end
            pos += n + int(torch.randint(0, 4, (1,), generator=g))  # then an observation
    values = torch.randn(B, T, generator=g)
    last_values = torch.randn(B, generator=g)
    truncated = torch.rand(B, generator=g) < 0.5
    groups = [b // 3 for b in range(B)]
    return rewards, mask, values, last_values, truncated, groups
