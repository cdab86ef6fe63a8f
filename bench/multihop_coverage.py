"""Coverage of the multi-hop data (``data=multihop``, ``retriever.corpus=multihop``): are
both hops there, and can the project's BM25 retriever reach them?

    python bench/multihop_coverage.py              # writes docs/BENCHMARKS.md and data/README.md
    python bench/multihop_coverage.py --no-write   # prints only

For the training rows (``data=multihop``) and the held-out ones (``data=multihop_test``):
the share whose two gold paragraphs are in the corpus; the share whose question alone
retrieves the first hop's paragraph in the top 3 (and both paragraphs); for bridge
questions, the share with a bridge phrase and the share of those whose phrase retrieves
the second hop in the top 3; for comparison questions, the share whose two entities each
retrieve their own paragraph. "Retrieves" is the env's own test (by id or title,
:func:`agentgym.envs.multihop.gold_hits`) on the BM25 index the local server builds
(``retriever_server.bm25``, same code, in-process). Also: the index build times of both
shipped corpora, NQ recall@3 on each (does the larger corpus hurt the one-hop questions?),
and how many training rows the cold start's builder turns into a two-search demonstration.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.core.paths import data_dir, shipped_corpus  # noqa: E402
from agentgym.data.rows import read_rows  # noqa: E402
from agentgym.envs.multihop import gold_hits, gold_paragraphs, strip_title  # noqa: E402
from agentgym.envs.multihop_demos import multihop_demo  # noqa: E402
from agentgym.envs.rewards import contains_answer, gold_answers  # noqa: E402
from agentgym.envs.search import SearchEnv  # noqa: E402
from agentgym.retriever_server.bm25 import BM25Index  # noqa: E402
from agentgym.retriever_server.corpus import read_corpus  # noqa: E402
from bench.report import machine, write_section  # noqa: E402

TITLE = "Multi-hop data: coverage of the corpus and BM25 reach"
TOPK = 3


class IndexRetriever:
    """The retriever client's interface over an in-process index (what the local server
    answers, without HTTP)."""

    def __init__(self, index: BM25Index, topk: int = TOPK) -> None:
        self.index, self.topk = index, topk

    def retrieve(self, queries: list[str]) -> list[list[dict]]:
        return [[{**d, "score": s} for d, s in hits]
                for hits in self.index.search(queries, self.topk)]

    def close(self) -> None:
        pass


def timed_index(name: str) -> tuple[BM25Index, float, int]:
    docs = read_corpus(shipped_corpus(name))
    t0 = time.perf_counter()
    index = BM25Index.build(docs)
    return index, time.perf_counter() - t0, len(docs)


def reach(index: BM25Index, rows: list[dict], corpus_ids: set[str]) -> dict:
    """The coverage figures of ``rows`` (module docstring) as counts."""
    golds = [gold_paragraphs(r) for r in rows]
    c = collections.Counter(rows=len(rows))
    c["both in corpus"] = sum(all(g["id"] in corpus_ids for g in gs) for gs in golds)
    top = index.search([r["extra_info"]["question"] for r in rows], TOPK)
    for gs, hits in zip(golds, top):
        found = gold_hits([d for d, _ in hits], gs)
        c["question -> hop 1"] += 0 in found
        c["question -> both"] += len(found) == 2
    bridge = [(r, gs) for r, gs in zip(rows, golds) if r["extra_info"]["type"] == "bridge"]
    phrased = [(r, gs) for r, gs in bridge if r["extra_info"].get("bridge")]
    c["bridge"], c["bridge with a phrase"] = len(bridge), len(phrased)
    top = index.search([r["extra_info"]["bridge"] for r, _ in phrased], TOPK)
    c["bridge phrase -> hop 2"] = sum(1 in gold_hits([d for d, _ in hits], gs)
                                      for (_, gs), hits in zip(phrased, top))
    comp = [gs for r, gs in zip(rows, golds) if r["extra_info"]["type"] == "comparison"]
    c["comparison"] = len(comp)
    each = [[k in gold_hits([d for d, _ in hits], gs) for gs, hits in
             zip(comp, index.search([strip_title(gs[k]["title"]) for gs in comp], TOPK))]
            for k in (0, 1)]
    c["comparison: each entity -> its paragraph"] = sum(a and b for a, b in zip(*each))
    return dict(c)


def nq_recall(index: BM25Index) -> float:
    rows = read_rows(data_dir() / "search" / "nq_eval.jsonl")
    top = index.search([r["extra_info"]["question"] for r in rows], TOPK)
    return sum(any(contains_answer(d["contents"], gold_answers(r)) for d, _ in hits)
               for r, hits in zip(rows, top)) / len(rows)


def demos(index: BM25Index, rows: list[dict]) -> collections.Counter:
    """Two-search demonstrations the cold start's builder keeps, by question type."""
    env = SearchEnv(retriever=IndexRetriever(index), max_turns=4)
    kept = collections.Counter()
    for row in rows:
        kind = row["extra_info"]["type"]
        kept[f"{kind} rows"] += 1
        kept[f"{kind} kept"] += multihop_demo(row, env) is not None
    return kept


def share(n: int, d: int) -> str:
    return f"{n / d:.1%} ({n}/{d})" if d else "-"


def table(results: dict) -> str:
    keys = [("both gold paragraphs in the corpus", "both in corpus", "rows"),
            ("question alone: first hop in top 3", "question -> hop 1", "rows"),
            ("question alone: both hops in top 3", "question -> both", "rows"),
            ("bridge questions with a bridge phrase", "bridge with a phrase", "bridge"),
            ("bridge phrase: second hop in top 3", "bridge phrase -> hop 2",
             "bridge with a phrase"),
            ("comparison: each entity's search finds its paragraph",
             "comparison: each entity -> its paragraph", "comparison")]
    lines = ["| | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]
    for label, num, den in keys:
        lines.append(f"| {label} | " + " | ".join(share(r[num], r[den])
                                                  for r in results.values()) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    wiki, wiki_s, wiki_n = timed_index("wiki")
    nq_wiki = nq_recall(wiki)
    del wiki
    index, build_s, n_docs = timed_index("multihop")
    ids = {d["id"] for d in index.docs}
    sets = {"train (`data=multihop`)": read_rows(data_dir() / "multihop" / "train.jsonl.gz"),
            "held-out (`data=multihop_test`)": read_rows(data_dir() / "multihop" / "test.jsonl")}
    t0 = time.perf_counter()
    results = {name: reach(index, rows, ids) for name, rows in sets.items()}
    reach_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    kept = demos(index, sets["train (`data=multihop`)"])
    demo_s = time.perf_counter() - t0
    nq_multi = nq_recall(index)
    total = kept["bridge kept"] + kept["comparison kept"]
    body = (f"Machine: {machine()}. Command: `python bench/multihop_coverage.py`. BM25 "
            f"(bm25s, as the local retriever server builds it), top {TOPK}.\n\n"
            f"Index build: `retriever.corpus=wiki` {wiki_n:,} passages in {wiki_s:.1f} s; "
            f"`retriever.corpus=multihop` {n_docs:,} passages in {build_s:.1f} s. NQ held-out "
            f"answer recall@{TOPK}: {nq_wiki:.3f} (wiki) vs {nq_multi:.3f} (multihop).\n\n"
            + table(results) +
            f"\n\nTwo-search demonstrations the cold start's builder keeps among the "
            f"{len(sets['train (`data=multihop`)'])} training rows (each search's top {TOPK} "
            f"holds its gold paragraph, the answer rewarded 1.0): **{total}** "
            f"({kept['bridge kept']} of {kept['bridge rows']} bridge, "
            f"{kept['comparison kept']} of {kept['comparison rows']} comparison), built in "
            f"{demo_s:.0f} s; the coverage queries took {reach_s:.1f} s.")
    print(body)
    print(json.dumps({"results": results, "demos": kept}, indent=1), file=sys.stderr)
    if not args.no_write:
        write_section(TITLE, body)
        write_section(TITLE, body, doc=ROOT / "data" / "README.md")


if __name__ == "__main__":
    main()
