"""Answer-matching rewards for QA (SQuAD normalization, as Search-R1 uses)."""

from __future__ import annotations

import collections
import re
import string

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DROP_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace (SQuAD v1.1).
    ``str.translate`` drops the punctuation: fast enough to normalize a whole corpus
    (:mod:`agentgym.envs.answerable`)."""
    s = _ARTICLES.sub(" ", s.lower().translate(_DROP_PUNCT))
    return " ".join(s.split())


def _normalize_pair(prediction: str, gold: str) -> tuple[str, str]:
    """SQuAD normalization of both, except where it would erase the gold answer (``"A+"``,
    ``"---"`` become ``""``, which an empty or article-only answer would then match): there
    both keep their punctuation and articles, lowercased with whitespace collapsed."""
    g = normalize_answer(gold)
    if g or not gold.strip():
        return normalize_answer(prediction), g
    return " ".join(prediction.lower().split()), " ".join(gold.lower().split())


def contains_answer(text: str, golds: list[str] | str) -> bool:
    """Whether a gold answer occurs in ``text`` as whole words, both SQuAD-normalized (the
    test the answerable filter and the demonstration builder apply to passages)."""
    golds = [golds] if isinstance(golds, str) else golds
    hay = f" {normalize_answer(text)} "
    return any(g and f" {g} " in hay for g in map(normalize_answer, golds))


def exact_match(prediction: str, golds: list[str] | str) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    golds = [golds] if isinstance(golds, str) else golds
    return float(any(p == g for p, g in (_normalize_pair(prediction, g) for g in golds)))


def f1_score(prediction: str, golds: list[str] | str) -> float:
    """Best token-level F1 between the prediction and any gold answer."""
    golds = [golds] if isinstance(golds, str) else golds
    best = 0.0
    for gold in golds:
        p, g = _normalize_pair(prediction, gold)
        p_tokens, g_tokens = p.split(), g.split()
        common = collections.Counter(p_tokens) & collections.Counter(g_tokens)
        same = sum(common.values())
        if same == 0:
            continue
        precision, recall = same / len(p_tokens), same / len(g_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def gold_answers(row: dict) -> list[str]:
    """A search row's gold answers (``reward_model.ground_truth``: a string, a list, or
    ``{"target": …}`` as in Search-R1's parquet)."""
    target = row["reward_model"]["ground_truth"]
    if isinstance(target, dict):
        target = target["target"]
    return [target] if isinstance(target, str) else list(target)
