"""HTTP client of a Search-R1-compatible retrieval server, and Search-R1's passage format.

No torch, FastAPI or server imports: plain dicts over httpx, so env worker processes stay
light. Speaks the API of ``retriever_server`` (and of Search-R1's own server).

Example::

    client = RetrieverClient("http://127.0.0.1:8000", topk=3)
    docs = client.retrieve(["who founded citibank"])[0]
    observation = format_docs(docs)   # 'Doc 1(Title: "Citibank") Citibank Citibank is ...'
"""

from __future__ import annotations

import functools
import logging
import time
import uuid

import httpx

from agentgym.supervision.supervisor import report_down, report_up
from agentgym.tools.errors import ToolBadRequest, ToolError, ToolTimeout, ToolUnavailable

logger = logging.getLogger(__name__)


@functools.cache
def _tls():
    """One TLS context for every client (httpx's default verification): building it loads
    the CA bundle, about 30 ms a client, and the search env makes a client per env
    instance (0.1 ms with this one; 44 s of CPU in one `make demo` before)."""
    return httpx.create_ssl_context()


__all__ = ["RetrieverClient", "format_docs", "ToolError", "ToolTimeout", "ToolUnavailable",
           "ToolBadRequest"]


class RetrieverClient:
    """Synchronous client of ``POST /retrieve``; safe to share between threads.

    Transient failures (connection errors, timeouts, 5xx answers) are retried ``retries``
    times with exponential backoff (``backoff * 2**attempt`` seconds); a 4xx answer raises
    :class:`ToolBadRequest` at once. When every attempt failed the service is reported down
    (:func:`agentgym.supervision.supervisor.report_down`: its outage is counted, and a local server
    is restarted by its supervisor); the next answer reports it up. Each call sends one ``X-Request-ID`` (uuid4), the same
    on its retries, so server logs can tie the attempts together.

    One ``httpx.Client`` (documented thread-safe; its pool has its own locking) is shared
    by all threads, so connections are reused across the env worker pool.

    Args:
        url: server base URL, with or without the trailing ``/retrieve``.
        topk: passages per query.
        timeout: seconds for each of connect / read / write of one attempt.
        retries: extra attempts after the first for transient failures.
        backoff: first retry delay in seconds.
    """

    def __init__(self, url: str, topk: int = 3, timeout: float = 5.0, retries: int = 2,
                 backoff: float = 0.2) -> None:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(f"need timeout > 0, retries >= 0, backoff >= 0; got "
                             f"timeout={timeout}, retries={retries}, backoff={backoff}")
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.base = self.url[: -len("/retrieve")]  # the service, as its supervisor names it
        self.topk, self.retries, self.backoff = topk, retries, backoff
        self._http = httpx.Client(timeout=httpx.Timeout(timeout), verify=_tls())

    def retrieve(self, queries: list[str]) -> list[list[dict]]:
        """Top passages for each query.

        Args:
            queries: query strings (non-blank; the server caps count and length).

        Returns:
            ``result[i]``: up to ``topk`` dicts ``{"id", "contents", "score"}`` for
            ``queries[i]``, best first.

        Raises:
            ToolBadRequest: the server rejected the request (4xx).
            ToolTimeout: the last attempt timed out.
            ToolUnavailable: the server was unreachable or answered 5xx on every attempt.
            ToolError: the server answered 200 with a body of the wrong shape.
        """
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": self.topk, "return_scores": True}
        headers = {"X-Request-ID": str(uuid.uuid4())}
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = self._http.post(self.url, json=payload, headers=headers)
            except httpx.TimeoutException as e:
                error: ToolError = ToolTimeout(f"{self.url} did not answer in time "
                                               f"({type(e).__name__}: {e})")
            except httpx.TransportError as e:
                error = ToolUnavailable(f"cannot reach {self.url} ({type(e).__name__}: {e})")
            else:
                if resp.status_code < 400:
                    report_up(self.base)
                    return self._parse(resp, len(queries))
                if resp.status_code < 500:
                    raise ToolBadRequest(f"{self.url} rejected the request "
                                         f"(HTTP {resp.status_code}): {_error_text(resp)}")
                error = ToolUnavailable(f"{self.url} failed (HTTP {resp.status_code}): "
                                        f"{_error_text(resp)}")
            if attempt < self.retries:
                logger.warning("retrieval attempt %d/%d [%s] failed, retrying: %s",
                               attempt + 1, self.retries + 1, headers["X-Request-ID"], error)
        report_down(self.base, str(error))  # counted in infra/outage_s until it answers
        raise error

    def _parse(self, resp: httpx.Response, n_queries: int) -> list[list[dict]]:
        try:
            result = resp.json()["result"]
            if len(result) != n_queries:
                raise ValueError(f"{len(result)} result lists for {n_queries} queries")
            return [[{"id": str(hit["document"]["id"]), "contents": hit["document"]["contents"],
                      "score": hit.get("score")} for hit in hits] for hits in result]
        except (ValueError, KeyError, TypeError) as e:
            raise ToolError(f"malformed response from {self.url}: {type(e).__name__}: {e}; "
                            f"body starts {resp.text[:200]!r}") from e

    def close(self) -> None:
        """Close the connection pool (idempotent)."""
        self._http.close()

    def __enter__(self) -> RetrieverClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _error_text(resp: httpx.Response) -> str:
    """The server's error message: ``message`` or ``detail`` of a JSON body, else the text."""
    try:
        body = resp.json()
    except ValueError:
        body = resp.text
    if isinstance(body, dict):
        body = body.get("message") or body.get("detail") or body
    text = str(body)
    return text[:500] + ("…" if len(text) > 500 else "")


def format_docs(docs: list[dict]) -> str:
    """Passages as Search-R1 shows them to the model, byte for byte.

    For passage ``i`` with ``contents = '"Title"\\ntext'``: the title is the first line
    *as is* (wiki-18 titles keep their double quotes: ``Doc 1(Title: "Citibank") …``, which
    is what Search-R1-trained checkpoints saw), the text is the remaining lines::

        f"Doc {i+1}(Title: {title}) {text}\\n"   # concatenated over passages

    Args:
        docs: dicts with ``contents`` (as returned by :meth:`RetrieverClient.retrieve`), or
            Search-R1 hits ``{"document": {"contents": …}, "score": …}``.
    """
    out = []
    for idx, doc in enumerate(docs):
        content = doc["document"]["contents"] if "document" in doc else doc["contents"]
        title, _, text = content.partition("\n")
        out.append(f"Doc {idx + 1}(Title: {title}) {text}\n")
    return "".join(out)
