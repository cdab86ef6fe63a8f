"""Paired comparison of two models on the same questions.

A learning claim compares the same held-out questions before and after training; the
questions both models get right (or both wrong) say nothing about the difference, so the
test is on the discordant pairs: exact McNemar, a two-sided binomial test of ``b`` (only
the second model right) against ``c`` (only the first right) with p = 1/2.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    """Outcome of :func:`mcnemar`: ``n`` shared questions, the two rates, the discordant
    counts (``gained``: wrong before, right after; ``lost``: the reverse) and the exact
    two-sided p-value."""

    n: int
    before: float
    after: float
    gained: int
    lost: int
    p_value: float

    @property
    def delta(self) -> float:
        return self.after - self.before


def exact_binomial_two_sided(k: int, n: int) -> float:
    """Two-sided exact binomial test of ``k`` successes in ``n`` trials against p = 1/2
    (scipy's ``binomtest``); 1.0 when there are no trials."""
    if n == 0:
        return 1.0
    from scipy.stats import binomtest
    return float(binomtest(k, n, 0.5).pvalue)


def mcnemar(before: dict[str, bool], after: dict[str, bool]) -> Paired:
    """Exact McNemar test of two models' per-question outcomes, keyed by question id.

    Raises ValueError naming the ids when the two sets of questions differ: a paired test
    on different questions is not paired."""
    if set(before) != set(after):
        only_b = sorted(set(before) - set(after))[:5]
        only_a = sorted(set(after) - set(before))[:5]
        raise ValueError(f"the two evaluations cover different questions (only in the first: "
                         f"{only_b}, only in the second: {only_a}); evaluate both on the same "
                         f"data and limit")
    n = len(before)
    gained = sum(1 for q in before if after[q] and not before[q])
    lost = sum(1 for q in before if before[q] and not after[q])
    return Paired(n=n, before=sum(before.values()) / max(n, 1),
                  after=sum(after.values()) / max(n, 1), gained=gained, lost=lost,
                  p_value=exact_binomial_two_sided(gained, gained + lost))


def wilson_ci95(p: float, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sensible at 0 and 1, unlike p ± 1.96·se)."""
    import math
    if n == 0:
        return float("nan"), float("nan")
    z = 1.96
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one question (Chen et al. 2021): the chance that at least one
    of ``k`` samples drawn without replacement from ``n``, of which ``c`` are correct, is
    correct, ``1 - C(n-c, k) / C(n, k)``, computed as a product so large ``n`` is exact."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def bootstrap_ci95(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-question ``values`` (resampling
    questions; a fixed seed, so the same values give the same interval)."""
    import numpy as np
    if not values:
        return float("nan"), float("nan")
    x = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
