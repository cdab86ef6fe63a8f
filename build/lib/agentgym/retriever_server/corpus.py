"""Reading a passage corpus in Search-R1's JSONL format (optionally gzipped).

One passage per line::

    {"id": "0", "contents": "\\"Citibank\\"\\n..."}      (other fields such as title/text ignored)

``contents`` is what is indexed and returned; by the wiki-18 convention its first line is
the quoted title.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def read_corpus(path: str | Path) -> list[dict]:
    """Read a JSONL(.gz) corpus into ``[{"id": str, "contents": str}, ...]``.

    Raises:
        ValueError: a line is not JSON or lacks ``contents`` (names file and line).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                contents = row["contents"]
                if not isinstance(contents, str):
                    raise TypeError(f"'contents' is {type(contents).__name__}, not a string")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with 'id' and "
                                 f"'contents' ({type(e).__name__}: {e})") from e
            docs.append({"id": str(row.get("id", len(docs))), "contents": contents})
    if not docs:
        raise ValueError(f"corpus {path} has no passages")
    return docs


DOCS_FILE = "docs.jsonl"


def write_docs(directory: Path, docs: list[dict]) -> None:
    """Write ``docs`` as ``directory/docs.jsonl`` (via a temporary file)."""
    tmp = directory / (DOCS_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    tmp.replace(directory / DOCS_FILE)


def read_docs(directory: Path) -> list[dict]:
    """The passages saved by :func:`write_docs`."""
    with open(Path(directory) / DOCS_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f]
