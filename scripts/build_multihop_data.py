"""Build the multi-hop search data (``data=multihop``, ``retriever.corpus=multihop``) from
HotpotQA distractor-setting files with their paragraphs (see data/README.md, "multihop/").

    python scripts/build_multihop_data.py                 # raw files in .cache/multihop_raw/
    python scripts/build_multihop_data.py /path/to/raw    # or there
    python scripts/build_multihop_data.py --split-only    # re-split the shipped questions

Two stages, both deterministic (same input, same bytes; gzip headers carry no timestamp):

1. Collect (needs the raw files of :data:`SOURCES`, each checked by its sha256): every
   question with its ten paragraphs, deduplicated by HotpotQA id (first source wins);
   the paragraphs deduplicated by title and whitespace-collapsed text. Writes
   ``data/multihop/corpus.jsonl.gz`` (the paragraphs the shipped wiki corpus lacks; one it
   already holds keeps its wiki id) and ``data/multihop/questions.jsonl.gz`` (each question,
   its gold and context paragraph ids, where it came from).
2. Split (needs only the repository): ``data/multihop/test.jsonl`` (500 held-out questions)
   and ``data/multihop/train.jsonl.gz`` (the rest, disjoint from every held-out set by
   question and by gold-paragraph pair), rows in verl's format with Search-R1's prompt.
"""

from __future__ import annotations

import argparse
import ast
import collections
import gzip
import hashlib
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.envs.multihop import hop_order, strip_title  # noqa: E402
from agentgym.envs.rewards import normalize_answer  # noqa: E402
from agentgym.envs.search_prompt import make_prompt  # noqa: E402

_RPT = ("megagonlabs/RPT", "cf2bc1b1b4edd0318b84179e732ec476c4e20a6e")
_AMOR = ("JianGuanTHU/AMOR", "bdb64700e79a09684cd6eee50b2842166c4bf996")
#: (local file name, repo, commit, path in the repo, sha256, format), in precedence order
#: (a question in several files is taken from the first): the typed sources first,
#: IRCoT's processed file (no question type) last.
SOURCES = [
    ("rpt_train.jsonl", *_RPT, "data/hotpotqa/train.jsonl",
     "e587f80176337ff705ca2f9c178f2bd784280b388abf302ad4071c482baa0dfb", "hotpot"),
    ("rpt_dev.jsonl", *_RPT, "data/hotpotqa/dev.jsonl",
     "c6fa5317cc316b65b3c82d441ea641aef4a588b4aaec9377bbd167637d8665e8", "hotpot"),
    ("rpt_test.jsonl", *_RPT, "data/hotpotqa/test.jsonl",
     "3ab48ee61e64301dff1efbb956ca5ebdfcd1569a2e9d7381fd882e070badfb2a", "hotpot"),
    ("amor_dev.json", *_AMOR, "data/hotpotqa/dev.json",
     "96296f21ea67a6e7b18017f657f7c1181e3aebdbd337993500f3280a1c4d7c28", "hotpot"),
    ("amor_test.json", *_AMOR, "data/hotpotqa/test.json",
     "d2d566c667d789508aa3511d89cfcc3480fc9d62e556a09331be9376be42c075", "hotpot"),
    ("benchfortir_test.jsonl", "leeyeezeee/benchfortir",
     "d38c0dc9e4f27f474e29f3cf0e359e91c340107f", "data/hotpotqa/test.jsonl",
     "c0ffa04c4ec2ef84ee4a78923dd89ec67561337eb3b5a3a7112db812ee377d9e", "hotpot"),
    ("meve_hotpot_dev_distractor.json", "nakulbh/Meve-framework",
     "3f7fcf19955a5f3e42d8d2a3cb569a944d772280", "data/hotpot_dev_distractor_v1.json",
     "32ed3ffab548f1d57ba65365bd581d17b428980fa7be881ab0c45f79d9fe6827", "hotpot"),
    ("hipporag_hotpotqa_train.json", "OSU-NLP-Group/HippoRAG",
     "3d95d255a8db0c1699b853cfb4fbe5056708162d", "data/hotpotqa_train.json",
     "6c0e2689d03c94b3bb4d5f94ed806ea4f4eb4f46c12132f8e91df774ad5c5a22", "hotpot"),
    ("ircot_hotpotqa_dev_subsampled.jsonl", "xindili-cmu/anlp-project-multihop",
     "11ba72982918286f4bc602fb0cd87b5e2a145860", "processed_data/hotpotqa/dev_subsampled.jsonl",
     "837a919903fedf521211c4271f168ad5458488198e9c4d967bf5f3a579525ce8", "ircot"),
]
N_TEST, SEED = 500, 0
DATA = ROOT / "data"
WIKI = DATA / "corpus" / "wiki_passages.jsonl.gz"


def norm(question: str) -> str:
    """Key for overlap checks: lowercase, collapsed whitespace, no trailing '?' (as
    scripts/build_search_data.py)."""
    return " ".join(question.lower().split()).rstrip("?").strip()


def collapse(text: str) -> str:
    return " ".join(text.split())


def read_records(path: Path) -> list[dict]:
    """A JSON array, or JSON lines."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _field(value):
    """AMOR stores ``context`` and ``supporting_facts`` as Python reprs."""
    return ast.literal_eval(value) if isinstance(value, str) else value


def normalize(rec: dict, fmt: str) -> dict:
    """One question as ``{id, question, answer, type, level, context: [(title, text)],
    gold: [titles]}`` from HotpotQA's own format (a list or the HF column form of
    ``context``/``supporting_facts``) or IRCoT's processed one."""
    if fmt == "ircot":
        ctx = [(c["title"], collapse(c["paragraph_text"])) for c in rec["contexts"]]
        gold = [c["title"] for c in rec["contexts"] if c["is_supporting"]]
        return {"id": rec["question_id"], "question": rec["question_text"],
                "answer": rec["answers_objects"][0]["spans"][0], "type": None, "level": None,
                "context": ctx, "gold": list(dict.fromkeys(gold))}
    context, facts = _field(rec["context"]), _field(rec["supporting_facts"])
    if isinstance(context, dict):  # datasets' columns: {"title": [...], "sentences": [...]}
        context = list(zip(context["title"], context["sentences"]))
    gold = facts["title"] if isinstance(facts, dict) else [f[0] for f in facts]
    qid = rec.get("_id") or rec.get("id")  # Meve's copy has no ids: one from the question
    qid = qid or "q-" + hashlib.sha1(rec["question"].encode("utf-8")).hexdigest()[:24]
    return {"id": qid, "question": rec["question"],
            "answer": rec["answer"], "type": rec.get("type"), "level": rec.get("level"),
            "context": [(t, collapse("".join(s))) for t, s in context],
            "gold": list(dict.fromkeys(gold))}


def infer_type(question: str, answer: str, gold: list[str]) -> str:
    """IRCoT's file has no type: comparison when the answer is yes/no, or the question names
    both gold titles and the answer is (part of) one of them; else bridge (measured on the
    typed questions: data/README.md)."""
    a = normalize_answer(answer)
    if a in ("yes", "no"):
        return "comparison"
    titles = [normalize_answer(strip_title(t)) for t in gold]
    q = f" {normalize_answer(question)} "
    if all(t and f" {t} " in q for t in titles) and any(a in t or t in a for t in titles):
        return "comparison"
    return "bridge"


def check_sources(raw: Path) -> None:
    missing = [f"{name} <- {repo} @ {commit}: {path}"
               for name, repo, commit, path, _, _ in SOURCES if not (raw / name).is_file()]
    if missing:
        raise SystemExit(f"raw files missing in {raw} (fetch each file at that commit and "
                         f"save it under the name on the left):\n  " + "\n  ".join(missing))
    for name, repo, commit, path, sha, _ in SOURCES:
        got = hashlib.sha256((raw / name).read_bytes()).hexdigest()
        if got != sha:
            raise SystemExit(f"{raw / name}: sha256 {got}, expected {sha} ({repo} @ "
                             f"{commit[:8]}: {path}); not the file this build was made from")


def collect(raw: Path) -> tuple[list[dict], dict, dict]:
    """Every question (first source wins) and its paragraphs; ``(questions, stats,
    paragraphs: (title, text) -> None in first-seen order)``."""
    check_sources(raw)
    questions, seen, stats = [], set(), collections.Counter()
    paragraphs: dict[tuple[str, str], None] = {}
    for name, *_, fmt in SOURCES:
        for i, rec in enumerate(read_records(raw / name)):
            q = normalize(rec, fmt)
            stats["read"] += 1
            key = norm(q["question"])
            if q["id"] in seen or key in seen:
                stats["duplicate"] += 1
                continue
            titles = [t for t, _ in q["context"]]
            if len(q["gold"]) != 2 or any(titles.count(t) != 1 for t in q["gold"]):
                stats["not two gold paragraphs in its context"] += 1
                continue
            seen |= {q["id"], key}
            q["source"] = f"{name}:{i + 1}"
            q["type_inferred"] = q["type"] is None
            guess = infer_type(q["question"], q["answer"], q["gold"])
            if q["type"] is None:
                q["type"] = guess
            else:  # how often the heuristic is right where the type is known
                stats["typed"] += 1
                stats["typed: heuristic agrees"] += guess == q["type"]
            questions.append(q)
            for para in q["context"]:
                paragraphs.setdefault(para)
    return questions, stats, paragraphs


def wiki_ids() -> dict[tuple[str, str], str]:
    """``(title, collapsed text) -> id`` of the shipped wiki corpus (first id wins)."""
    out: dict[tuple[str, str], str] = {}
    with gzip.open(WIKI, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            out.setdefault((doc["title"], collapse(doc["text"])), doc["id"])
    return out


def write_gz(path: Path, rows: list[dict]) -> None:
    """JSON lines, gzipped with no name and mtime 0 in the header: same rows, same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               compresslevel=9, mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_corpus(raw: Path, out: Path) -> dict:
    """Stage 1: ``out/corpus.jsonl.gz`` and ``out/questions.jsonl.gz``; returns counts."""
    questions, stats, paragraphs = collect(raw)
    wiki = wiki_ids()
    ids, corpus = {}, []
    for title, text in paragraphs:
        pid = wiki.get((title, text))
        if pid is None:
            pid = f"hp-{len(corpus):05d}"
            corpus.append({"id": pid, "title": title, "text": text,
                           "contents": f'"{title}"\n{text}'})
        ids[(title, text)] = pid
    records = []
    for q in questions:
        by_title = dict(q["context"])
        records.append({"id": q["id"], "question": q["question"], "answer": q["answer"],
                        "type": q["type"], "type_inferred": q["type_inferred"],
                        "hotpotqa_level": q["level"],
                        "gold": [ids[(t, by_title[t])] for t in q["gold"]],
                        "context": [ids[p] for p in q["context"]], "source": q["source"]})
    write_gz(out / "corpus.jsonl.gz", corpus)
    write_gz(out / "questions.jsonl.gz", records)
    return {**stats, "questions": len(records), "paragraphs": len(paragraphs),
            "in wiki corpus": len(paragraphs) - len(corpus), "new passages": len(corpus)}


def passages(out: Path) -> dict[str, tuple[str, str]]:
    """``id -> (title, text)`` over the wiki corpus and ``out/corpus.jsonl.gz``."""
    table = {}
    for path in (WIKI, out / "corpus.jsonl.gz"):
        for doc in read_gz(path):
            table[doc["id"]] = (doc["title"], doc["text"])
    return table


def verl_row(q: dict, split: str, index: int, table: dict) -> dict:
    golds = [table[pid] for pid in q["gold"]]
    order, bridge = hop_order(q["question"], q["type"], golds)
    extra = {"split": split, "index": index, "question": q["question"], "id": q["id"],
             "source": q["source"], "type": q["type"], "hops": 2,
             "gold_paragraphs": [{"id": q["gold"][k], "title": golds[k][0]} for k in order],
             "bridge": bridge, "hotpotqa_level": q["hotpotqa_level"]}
    if q["type_inferred"]:
        extra["type_inferred"] = True
    return {"data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": make_prompt(q["question"])}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": [q["answer"]]}},
            "extra_info": extra, "env": "search"}


def pair(q: dict, table: dict) -> frozenset:
    """The question's gold pair, by title (stricter than by id: another version of the
    same article is the same paragraph)."""
    return frozenset(table[pid][0] for pid in q["gold"])


def split_rows(out: Path) -> dict:
    """Stage 2: ``out/test.jsonl`` and ``out/train.jsonl.gz`` from the shipped questions."""
    questions, table = read_gz(out / "questions.jsonl.gz"), passages(out)
    missing = sorted({pid for q in questions for pid in q["gold"]} - set(table))
    if missing:
        raise SystemExit(f"gold paragraphs missing from the corpus: {missing[:5]}")
    eval_500 = {norm(r["extra_info"]["question"]): r
                for r in map(json.loads, open(DATA / "search" / "hotpotqa_eval.jsonl"))}
    search_train = {norm(json.loads(line)["extra_info"]["question"])
                    for line in open(DATA / "search" / "train.jsonl")}
    held_pairs = {pair(q, table) for q in questions if norm(q["question"]) in eval_500}
    eligible = sorted((q for q in questions if not q["type_inferred"]
                       and norm(q["question"]) not in eval_500
                       and norm(q["question"]) not in search_train), key=lambda q: q["id"])
    rng = random.Random(SEED)
    test = rng.sample(eligible, N_TEST)
    test_q = {norm(q["question"]) for q in test}
    held_pairs |= {pair(q, table) for q in test}
    train = [q for q in sorted(questions, key=lambda q: q["id"])
             if norm(q["question"]) not in eval_500 and norm(q["question"]) not in test_q
             and pair(q, table) not in held_pairs]
    rng.shuffle(train)
    test_rows = [verl_row(q, "test", i, table) for i, q in enumerate(test)]
    train_rows = [verl_row(q, "train", i, table) for i, q in enumerate(train)]
    check_disjoint(train_rows, test_rows, eval_500)
    write_jsonl(out / "test.jsonl", test_rows)
    write_gz(out / "train.jsonl.gz", train_rows)
    return {"test": _types(test_rows), "train": _types(train_rows),
            "left out of train (a held-out question or gold pair)":
                len(questions) - len(train) - len(test)}


def _types(rows: list[dict]) -> dict:
    c = collections.Counter(r["extra_info"]["type"] + (" (inferred)" if r["extra_info"].get(
        "type_inferred") else "") for r in rows)
    return {"rows": len(rows), **dict(sorted(c.items()))}


def check_disjoint(train: list[dict], test: list[dict], eval_500: dict) -> None:
    """Fail unless training shares no question with a held-out set, nor a gold pair with
    multihop_test; every gold paragraph is named by id and title."""
    tq = {norm(r["extra_info"]["question"]) for r in train}
    overlap = tq & ({norm(r["extra_info"]["question"]) for r in test} | set(eval_500))
    if overlap:
        raise SystemExit(f"train/held-out question overlap: {sorted(overlap)[:5]}")
    if len(tq) != len(train):
        raise SystemExit(f"train has {len(train) - len(tq)} duplicate questions")
    pairs = lambda rows: {frozenset(g["title"] for g in r["extra_info"]["gold_paragraphs"])
                          for r in rows}
    if pairs(train) & pairs(test):
        raise SystemExit(f"train/test gold-pair overlap: {list(pairs(train) & pairs(test))[:3]}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", nargs="?", type=Path, default=ROOT / ".cache" / "multihop_raw")
    p.add_argument("--out", type=Path, default=DATA / "multihop")
    p.add_argument("--split-only", action="store_true",
                   help="stage 2 only: re-split the shipped questions.jsonl.gz")
    args = p.parse_args(argv)
    if not args.split_only:
        print("collected:", json.dumps(build_corpus(args.raw, args.out)))
    print("split:", json.dumps(split_rows(args.out)))


if __name__ == "__main__":
    main()
