"""RetrieverClient against a real retrieval server, and against named fault injectors
(small FastAPI apps served by uvicorn on loopback) for timeouts, 5xx and 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import itertools
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentgym.tools.local_retriever import LocalRetriever
from agentgym.tools.retriever import (RetrieverClient, ToolBadRequest, ToolError, ToolTimeout,
                             ToolUnavailable, format_docs)

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "wiki_passages.jsonl.gz"
OK_BODY = {"result": [[{"document": {"id": "7", "contents": '"T"\nbody'}, "score": 1.5}]]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: FastAPI):
    """Run ``app`` with uvicorn on a free loopback port in a daemon thread; yield its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "fault server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


class SlowRetrieverFault:
    """Fault injector: a /retrieve that answers only after ``delay_s`` seconds."""

    def __init__(self, delay_s: float):
        self.calls = 0
        self.app = FastAPI()

        @self.app.post("/retrieve")
        async def retrieve():
            self.calls += 1
            await asyncio.sleep(delay_s)
            return OK_BODY


class ScriptedStatusFault:
    """Fault injector: /retrieve answers the scripted HTTP statuses in order, then 200 with a
    valid body; records each request's headers."""

    def __init__(self, statuses: list[int]):
        self.statuses, self.headers = list(statuses), []
        self.app = FastAPI()

        @self.app.post("/retrieve")
        async def retrieve(request: Request):
            self.headers.append(dict(request.headers))
            if self.statuses:
                status = self.statuses.pop(0)
                return JSONResponse({"message": f"injected HTTP {status}"}, status_code=status)
            return OK_BODY


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with gzip.open(CORPUS, "rt", encoding="utf-8") as src:
        corpus.write_text("".join(itertools.islice(src, 2000)), encoding="utf-8")
    with LocalRetriever(corpus, index_dir=tmp_path_factory.mktemp("idx") / "bm25") as r:
        yield r.url


def test_retrieve_from_real_server(url):
    with RetrieverClient(url, topk=2) as client:
        result = client.retrieve(["Lockheed SR-71 Blackbird", "gluten-free diet"])
    assert [len(hits) for hits in result] == [2, 2]
    for hits in result:
        for doc in hits:
            assert set(doc) == {"id", "contents", "score"} and isinstance(doc["score"], float)
    assert result[0][0]["contents"].startswith('"Lockheed SR-71 Blackbird"\n')
    assert format_docs(result[0]).startswith('Doc 1(Title: "Lockheed SR-71 Blackbird") ')


def test_url_may_end_with_retrieve_and_empty_batch_needs_no_call(url):
    client = RetrieverClient(url + "/retrieve/", topk=1)
    assert client.url == url + "/retrieve"
    assert len(client.retrieve(["uranus"])[0]) == 1
    assert client.retrieve([]) == []
    client.close()
    client.close()  # idempotent


def test_shared_client_is_thread_safe(url):
    queries = ["Doris A. Davis", "Ted Berry", "House of Hanover", "George Stephenson"] * 6
    with RetrieverClient(url, topk=1) as client, ThreadPoolExecutor(8) as pool:
        tops = list(pool.map(lambda q: client.retrieve([q])[0][0]["contents"], queries))
    assert all(top.startswith(f'"{q}"\n') for q, top in zip(queries, tops))


def test_format_docs_is_search_r1_format():
    docs = [{"id": "1", "contents": '"Paris"\nParis is the capital.\nSecond line.', "score": 2.0},
            {"id": "2", "contents": "no title line"},
            {"document": {"id": "3", "contents": '"Rome"\nRome.'}, "score": 1.0}]
    assert format_docs(docs) == ('Doc 1(Title: "Paris") Paris is the capital.\nSecond line.\n'
                                 'Doc 2(Title: no title line) \n'
                                 'Doc 3(Title: "Rome") Rome.\n')
    assert format_docs([]) == ""


def test_closed_port_is_unavailable_quickly():
    client = RetrieverClient(f"http://127.0.0.1:{free_port()}", timeout=0.5, retries=1,
                             backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(ToolUnavailable, match="cannot reach"):
        client.retrieve(["anything"])
    assert time.monotonic() - t0 < 2


def test_slow_server_times_out_after_retries():
    fault = SlowRetrieverFault(delay_s=1.0)
    with serve_in_thread(fault.app) as base:
        client = RetrieverClient(base, timeout=0.2, retries=1, backoff=0.01)
        t0 = time.monotonic()
        with pytest.raises(ToolTimeout):
            client.retrieve(["anything"])
        elapsed = time.monotonic() - t0
        client.close()
    assert fault.calls == 2  # timeouts are transient: retried once
    assert elapsed < 0.9


def test_503_is_retried_once_then_succeeds_with_one_request_id():
    fault = ScriptedStatusFault([503])
    with serve_in_thread(fault.app) as base, RetrieverClient(base, retries=2,
                                                            backoff=0.01) as client:
        result = client.retrieve(["anything"])
    assert result == [[{"id": "7", "contents": '"T"\nbody', "score": 1.5}]]
    assert len(fault.headers) == 2
    ids = {h["x-request-id"] for h in fault.headers}
    assert len(ids) == 1 and uuid.UUID(ids.pop()).version == 4


def test_persistent_5xx_is_unavailable():
    fault = ScriptedStatusFault([500, 502, 503])
    with serve_in_thread(fault.app) as base, RetrieverClient(base, retries=2,
                                                            backoff=0.01) as client:
        with pytest.raises(ToolUnavailable, match="HTTP 503.*injected"):
            client.retrieve(["anything"])
    assert len(fault.headers) == 3


def test_4xx_raises_bad_request_without_retry():
    fault = ScriptedStatusFault([422])
    with serve_in_thread(fault.app) as base, RetrieverClient(base, retries=2,
                                                            backoff=0.01) as client:
        with pytest.raises(ToolBadRequest, match="HTTP 422.*injected HTTP 422"):
            client.retrieve(["anything"])
    assert len(fault.headers) == 1


def test_real_server_4xx_message_reaches_the_caller(url):
    with RetrieverClient(url, topk=1000) as client:
        with pytest.raises(ToolBadRequest, match="topk"):
            client.retrieve(["uranus"])
        with pytest.raises(ToolBadRequest, match=r"queries\[0\]"):
            client.retrieve(["   "])


def test_malformed_200_is_a_tool_error():
    app = FastAPI()  # MalformedRetrieverFault: answers 200 with a body lacking "result"
    app.post("/retrieve")(lambda: {"results": []})
    with serve_in_thread(app) as base, RetrieverClient(base, retries=0) as client:
        with pytest.raises(ToolError, match="malformed response"):
            client.retrieve(["anything"])


def test_errors_share_the_base_class():
    assert all(issubclass(e, ToolError) for e in (ToolTimeout, ToolUnavailable, ToolBadRequest))
