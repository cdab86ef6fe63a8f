"""Build the code environment's shipped data from ../shared/data/math (see data/README.md).

    python scripts/build_math_data.py                 # reads ../shared/data
    python scripts/build_math_data.py /path/to/shared/data

Writes, deterministically (same input, same bytes; the gzip header has no timestamp):
  data/math/gsm8k_train.jsonl.gz  all 7,473 GSM8K train problems (gzip: ~14 MB as text)
  data/math/gsm8k_test.jsonl      all 1,319 GSM8K test problems
  data/math/math500.jsonl         MATH-500 (500)
  data/math/aime24.jsonl          AIME 2024 I and II (30)

Every row holds ReTool's prompt (envs/code_prompt.py) and the answer string as
``reward_model.ground_truth``; GSM8K rows keep the full reference solution, with its
``<<48/2=24>>`` calculator annotations, in ``extra_info.solution``. File order is kept.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.envs.code import code_row  # noqa: E402


def norm(question: str) -> str:
    """Key for overlap checks: lowercase, collapsed whitespace."""
    return " ".join(question.lower().split())


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.suffix == ".gz":  # mtime=0 and no file name in the header: reproducible bytes
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                                   compresslevel=9, mtime=0) as gz:
            gz.write(text)
    else:
        path.write_bytes(text)


def gsm8k_answer(solution: str) -> str:
    """The text after '####', commas removed ('1,000' → '1000')."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####': {solution[-80:]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def gsm8k_rows(path: Path, split: str) -> list[dict]:
    return [code_row(r["question"], gsm8k_answer(r["answer"]), "gsm8k",
                     {"split": split, "index": i, "id": f"gsm8k_{split}_{i}",
                      "solution": r["answer"], "source": f"{path.name}:{i + 1}"})
            for i, r in enumerate(read_jsonl(path))]


def math500_rows(path: Path) -> list[dict]:
    return [code_row(r["problem"], r["answer"], "math500",
                     {"split": "test", "index": i, "id": r["unique_id"],
                      "subject": r["subject"], "level": r["level"], "solution": r["solution"],
                      "source": f"{path.name}:{i + 1}"})
            for i, r in enumerate(read_jsonl(path))]


def aime24_rows(path: Path) -> list[dict]:
    # Answers are integers 0-999; the source zero-pads some ("025"): store the integer.
    return [code_row(r["problem"], str(int(r["answer"])), "aime24",
                     {"split": "test", "index": i, "id": f"aime24_{r['id']}", "url": r["url"],
                      "source": f"{path.name}:{i + 1}"})
            for i, r in enumerate(read_jsonl(path))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shared_data", nargs="?", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--out", type=Path, default=ROOT / "data")
    args = p.parse_args(argv)
    src, out = args.shared_data / "math", args.out / "math"

    train = gsm8k_rows(src / "gsm8k_train.jsonl", "train")
    evals = {"gsm8k_test.jsonl": gsm8k_rows(src / "gsm8k_test.jsonl", "test"),
             "math500.jsonl": math500_rows(src / "math500.jsonl"),
             "aime24.jsonl": aime24_rows(src / "aime24.jsonl")}
    counts = {"gsm8k_test.jsonl": 1319, "math500.jsonl": 500, "aime24.jsonl": 30}
    if len(train) != 7473 or any(len(evals[k]) != n for k, n in counts.items()):
        raise SystemExit(f"unexpected sizes: train {len(train)}, "
                         f"{ {k: len(v) for k, v in evals.items()} }")

    train_q = {norm(r["extra_info"]["question"]) for r in train}
    if len(train_q) != len(train):
        raise SystemExit(f"train has duplicate questions: {len(train) - len(train_q)}")
    for name, rows in evals.items():
        overlap = train_q & {norm(r["extra_info"]["question"]) for r in rows}
        if overlap:
            raise SystemExit(f"train/{name} overlap: {sorted(overlap)[:3]}")

    write_jsonl(out / "gsm8k_train.jsonl.gz", train)
    for name, rows in evals.items():
        write_jsonl(out / name, rows)
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    print(f"train: {len(train)} gsm8k; eval: "
          + ", ".join(f"{k} {len(v)}" for k, v in evals.items())
          + "; train/eval question overlap: 0; bytes: "
          + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
