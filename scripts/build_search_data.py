"""Build the search environment's shipped data from ../shared/data (see data/README.md).

    python scripts/build_search_data.py                 # reads ../shared/data
    python scripts/build_search_data.py /path/to/shared/data

Writes, deterministically (same input, same bytes):
  data/corpus/wiki_passages.jsonl.gz  all 21,012 passages {id, title, text, contents}
  data/search/nq_eval.jsonl           first 500 questions of nq_test_sub1000 (file order)
  data/search/hotpotqa_eval.jsonl     the 500 two-hop questions of hotpotqa_dev_500 (file order)
  data/search/train.jsonl             2,000 NQ-open dev + 1,000 HotpotQA dev questions,
                                      excluding every evaluation question, shuffled
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.envs.search_prompt import make_prompt  # noqa: E402

CORPUS_FIELDS = ("id", "title", "text", "contents")
N_EVAL, N_TRAIN_NQ, N_TRAIN_HOTPOT, SEED = 500, 2000, 1000, 0


def norm(question: str) -> str:
    """Key for overlap checks: lowercase, collapsed whitespace, no trailing '?'."""
    return " ".join(question.lower().split()).rstrip("?").strip()


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def verl_row(source: str, question: str, answers: list[str], split: str, index: int,
             id_: str | None, origin: str) -> dict:
    return {"data_source": source,
            "prompt": [{"role": "user", "content": make_prompt(question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
            "extra_info": {"split": split, "index": index, "question": question, "id": id_,
                           "source": origin},
            "env": "search"}


def build_corpus(src: Path, dst: Path) -> int:
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    # mtime=0 and no file name in the header: rebuilding gives identical bytes.
    with open(dst, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               compresslevel=9, mtime=0) as gz:
        for line in open(src, encoding="utf-8"):
            row = json.loads(line)
            gz.write((json.dumps({k: row[k] for k in CORPUS_FIELDS}, ensure_ascii=False)
                      + "\n").encode("utf-8"))
            n += 1
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shared_data", nargs="?", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--out", type=Path, default=ROOT / "data")
    args = p.parse_args(argv)
    src, out = args.shared_data, args.out
    search = src / "search"

    n_docs = build_corpus(src / "corpus" / "wiki_passages.jsonl",
                          out / "corpus" / "wiki_passages.jsonl.gz")

    nq_test = read_jsonl(search / "nq_test_sub1000.jsonl")
    eval_rows = [verl_row("nq", r["question"], r["golden_answers"], "test", i, r["id"],
                          f"nq_test_sub1000.jsonl:{i + 1}")
                 for i, r in enumerate(nq_test[:N_EVAL])]

    hotpot_500 = read_jsonl(search / "hotpotqa_dev_500.jsonl")
    hotpot_rows = [verl_row("hotpotqa", r["question"], [r["answer"]], "test", i, None,
                            f"hotpotqa_dev_500.jsonl:{i + 1}")
                   for i, r in enumerate(hotpot_500)]

    # Exclude the whole 1,000-question NQ sample and HotpotQA's 500-question eval subset,
    # not only the 500 shipped: other eval sets drawn from them must stay unseen too.
    held_out = {norm(r["question"]) for r in nq_test}
    held_out |= {norm(r["question"]) for r in hotpot_500}
    nq_pool = [("nq", r["question"], r["answer"], f"nq_open_dev.jsonl:{i + 1}")
               for i, r in enumerate(read_jsonl(search / "nq_open_dev.jsonl"))
               if norm(r["question"]) not in held_out]
    with open(search / "hotpotqa_dev_qa.json", encoding="utf-8") as f:
        hotpot = json.load(f)
    hp_pool = [("hotpotqa", r["question"], [r["answer"]], f"hotpotqa_dev_qa.json:[{i}]")
               for i, r in enumerate(hotpot) if norm(r["question"]) not in held_out]
    rng = random.Random(SEED)
    picked = rng.sample(nq_pool, N_TRAIN_NQ) + rng.sample(hp_pool, N_TRAIN_HOTPOT)
    rng.shuffle(picked)
    train_rows = [verl_row(s, q, a, "train", i, None, origin)
                  for i, (s, q, a, origin) in enumerate(picked)]

    overlap = ({norm(r["extra_info"]["question"]) for r in train_rows}
               & {norm(r["extra_info"]["question"]) for r in eval_rows + hotpot_rows})
    if overlap:
        raise SystemExit(f"train/eval overlap: {sorted(overlap)[:5]}")
    n_unique = len({norm(r["extra_info"]["question"]) for r in train_rows})
    if n_unique != len(train_rows):
        raise SystemExit(f"train has duplicate questions: {len(train_rows) - n_unique}")

    write_jsonl(out / "search" / "nq_eval.jsonl", eval_rows)
    write_jsonl(out / "search" / "hotpotqa_eval.jsonl", hotpot_rows)
    write_jsonl(out / "search" / "train.jsonl", train_rows)
    print(f"corpus: {n_docs} passages; eval: {len(eval_rows)} (nq), {len(hotpot_rows)} "
          f"(hotpotqa); train: {len(train_rows)} "
          f"({N_TRAIN_NQ} nq of {len(nq_pool)} eligible, {N_TRAIN_HOTPOT} hotpotqa of "
          f"{len(hp_pool)}); train/eval overlap: {len(overlap)}")


if __name__ == "__main__":
    main()
