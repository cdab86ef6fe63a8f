"""Retrieval quality sanity: answer-string recall@k of dense and BM25 on the NQ eval sample.

    python bench/retriever_recall.py                      # both methods, shipped corpus
    python bench/retriever_recall.py --dtype bfloat16     # faster dense build on AMX CPUs

For each of the 500 held-out NQ questions shipped in ``data/search/nq_eval.jsonl``, a hit
at ``k`` means one of the top-``k`` passages contains a gold answer string (both
SQuAD-normalized, matched on word boundaries: the "has answer" test of DPR and
Search-R1's evaluations). The ceiling is the share of questions whose answer string occurs
anywhere in the corpus. Indexes are built with the same code as ``agentgym index build``
and cached under ``$AGENTGYM_CACHE/bench/`` (``ensure_index``), which
``bench/retriever_bench.py`` reuses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.core.paths import cache_dir, data_dir  # noqa: E402
from bench.report import write_section  # noqa: E402
from agentgym.envs.rewards import normalize_answer  # noqa: E402
from agentgym.retriever_server.corpus import read_corpus  # noqa: E402
from agentgym.retriever_server.encoder import EncoderSpec  # noqa: E402
from agentgym.retriever_server.index import (build_index, is_index, load_index,  # noqa: E402
                                             save_index)

CORPUS = data_dir() / "corpus" / "wiki_passages.jsonl.gz"
KS = (1, 3, 5, 10, 20)


def ensure_index(method: str, dtype: str = "float32", corpus: Path = CORPUS) -> Path:
    """A saved index of ``corpus`` (built on first use, with a progress line per 10%)."""
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:12]
    name = method if method == "bm25" else f"dense-minilm-{dtype}"
    out = cache_dir() / "bench" / f"{digest}-{name}"
    if is_index(out):
        return out
    docs = read_corpus(corpus)
    done, t0 = [0], time.perf_counter()

    def progress(k: int) -> None:
        before, done[0] = done[0], done[0] + k
        if before * 10 // len(docs) != done[0] * 10 // len(docs):
            print(f"  {method} index: {done[0]}/{len(docs)} passages, "
                  f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    options = {"spec": EncoderSpec(dtype=dtype)} if method == "dense" else {}
    save_index(build_index(docs, method, progress=progress, **options), out)
    print(f"built {method} index of {len(docs)} passages in {time.perf_counter() - t0:.0f}s "
          f"-> {out}", file=sys.stderr)
    return out


def load_questions(limit: int = 0) -> list[tuple[str, list[str]]]:
    rows = [json.loads(line) for line in open(data_dir() / "search" / "nq_eval.jsonl")]
    out = [(r["extra_info"]["question"], r["reward_model"]["ground_truth"]["target"])
           for r in rows]
    return out[:limit] if limit else out


def has_answer(text: str, answers: list[str]) -> bool:
    padded = f" {normalize_answer(text)} "
    return any(f" {a} " in padded for a in (normalize_answer(x) for x in answers) if a)


def recall_at_k(index, questions: list[tuple[str, list[str]]], batch: int = 64) -> dict:
    hits = {k: 0 for k in KS}
    t0 = time.perf_counter()
    for start in range(0, len(questions), batch):
        chunk = questions[start:start + batch]
        results = index.search([q for q, _ in chunk], max(KS))
        for (_, answers), docs in zip(chunk, results):
            first = next((i for i, (d, _) in enumerate(docs) if has_answer(d["contents"],
                                                                          answers)), None)
            for k in KS:
                hits[k] += first is not None and first < k
    seconds = time.perf_counter() - t0
    return {"recall": {k: hits[k] / len(questions) for k in KS}, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dense encoder precision")
    ap.add_argument("--limit", type=int, default=0, help="questions (0 = all 500)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    questions = load_questions(args.limit)
    corpus_text = " ".join(normalize_answer(d["contents"]) for d in read_corpus(CORPUS))
    ceiling = sum(any(f" {normalize_answer(a)} " in f" {corpus_text} " for a in answers
                      if normalize_answer(a)) for _, answers in questions) / len(questions)
    rows = {}
    for method in ("bm25", "dense"):
        index = load_index(ensure_index(method, args.dtype))
        rows[method] = recall_at_k(index, questions)
        r = rows[method]["recall"]
        print(f"{method:6s} " + "  ".join(f"R@{k} {r[k]:.3f}" for k in KS), flush=True)
    header = "| method | " + " | ".join(f"recall@{k}" for k in KS) + " | search time |"
    lines = [header, "|" + "---|" * (len(KS) + 2)]
    names = {"bm25": "BM25 (bm25s)", "dense": f"dense (all-MiniLM-L6-v2, {args.dtype}, faiss flat)"}
    for method, res in rows.items():
        lines.append(f"| {names[method]} | " + " | ".join(f"{res['recall'][k]:.3f}" for k in KS)
                     + f" | {res['seconds']:.1f}s |")
    body = (f"Machine: {platform.machine()}, {__import__('os').cpu_count()} CPUs. Command: "
            f"`python bench/retriever_recall.py{' --dtype ' + args.dtype if args.dtype != 'float32' else ''}`.\n"
            f"{len(questions)} NQ test questions (`data/search/nq_eval.jsonl`) against the "
            f"shipped 21,012-passage corpus. A hit at k: a gold answer string (SQuAD-normalized, "
            f"word boundaries) occurs in one of the top-k passages. Ceiling (answer string "
            f"anywhere in the corpus): **{ceiling:.3f}**.\n\n" + "\n".join(lines))
    print(body)
    if not args.no_write:
        write_section("Retriever quality: answer recall@k on NQ", body)


if __name__ == "__main__":
    main()
