"""SGLang's native HTTP API as the client uses it: request and response shapes, errors.

Checked against SGLang's source (``python/sglang/srt/managers/io_struct.py``:
``GenerateReqInput`` and the weight-update inputs;
``python/sglang/srt/entrypoints/http_server.py`` for the routes;
``python/sglang/srt/managers/tokenizer_manager.py`` for the response;
``python/sglang/srt/sampling/sampling_params.py`` for ``sampling_params``) and its docs
(``docs/basic_usage/native_api``, ``docs/basic_usage/sampling_params.md``,
``docs/advanced_features/sglang_for_rl.md``):

- request: ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature",
  "top_p", "top_k" (-1 = off; 0 is refused), "sampling_seed" (honoured by servers run
  with --enable-deterministic-inference), "no_stop_trim": true, "skip_special_tokens":
  false, "stop"?}, "return_logprob": true, "rid"}``. We always send temperature, top-p
  and top-k, since a server's ``--sampling-defaults model`` would otherwise fill them from
  the model's generation config.
- response: ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "cached_tokens", "weight_version", "output_token_logprobs":
  [[logprob, token_id, null], ...]}}`` (plus ``"text"`` from a server with a tokenizer);
  ``finish_reason`` is ``{"type": "stop", "matched": int | str}``, ``{"type": "length",
  "length": n}`` or ``{"type": "abort", "message"}``.
- stops and trimming: ``output_ids`` run through the token that finished the request (a
  matched EOS, or the token that completes a stop string), whatever ``no_stop_trim``
  says. The scheduler sends ``req.output_ids_through_stop``
  (``python/sglang/srt/managers/scheduler_output_processor_mixin.py``,
  ``stream_output_generation``), and ``DetokenizerManager.trim_matched_stop``
  (``python/sglang/srt/managers/detokenizer_manager.py``) trims only what is decoded
  into ``text``. ``no_stop_trim: true`` keeps the stop in ``text`` as well; the client
  never reads ``text``. A sampled EOS belongs to the trajectory with mask 1.
- logprobs: SGLang's sampled-token logprob is ``log_softmax(logits / temperature)``
  before top-k / top-p (its sampler; greedy: temperature 1), our engine contract
  (:class:`agentgym.core.types.SamplingParams`).
- errors: a bad request is a 400 ``{"error": {"message"}}``; 429/502/503/504 mean
  overloaded or restarting.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx

from agentgym.core.types import GenerateOutput, SamplingParams

#: Decoded tail examined for stop strings (as in the HF engine).
STOP_WINDOW = 32
#: HTTP statuses worth retrying: overloaded or restarting servers, gateways.
RETRY_STATUSES = frozenset({429, 502, 503, 504})


class SGLangServerError(RuntimeError):
    """A server failed a request; ``urls`` names the server(s) (and route)."""

    def __init__(self, message: str, urls: list[str]) -> None:
        super().__init__(message)
        self.urls = list(urls)


class EngineRequestError(SGLangServerError):
    """A server refused a request (4xx/500, or an answer we cannot use): not retried."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}", [url])
        self.url, self.status, self.message = url, status, message


class ServerUnavailableError(SGLangServerError):
    """Failures worth retrying (refused connection, timeout, 429/502/503/504, aborted
    request) went on until the retries ran out."""


class _Transient(Exception):
    """A failure worth retrying. Internal to the client: its retry loop turns the last
    one into :class:`ServerUnavailableError`, so no public method raises it."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


def error_message(resp: httpx.Response) -> str:
    """The message of an error answer (SGLang's ``{"error": {"message"}}`` and others)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


def combined_error(path: str, failures: list[BaseException]) -> BaseException:
    """One exception for the servers that failed ``path`` (every one named)."""
    odd = [e for e in failures if not isinstance(e, SGLangServerError)]
    if odd:
        return odd[0]
    if len(failures) == 1:
        return failures[0]
    urls = [u for e in failures for u in e.urls]  # type: ignore[attr-defined]
    message = f"{path} failed on {len(failures)} servers: " + "; ".join(map(str, failures))
    if all(isinstance(e, EngineRequestError) for e in failures):
        return SGLangServerError(message, urls)
    return ServerUnavailableError(message, urls)


def sglang_sampling(sampling: SamplingParams, server_stops: bool) -> dict:
    """Our :class:`SamplingParams` as SGLang's ``sampling_params``."""
    p: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens,
                         "temperature": sampling.temperature, "top_p": sampling.top_p,
                         "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                         "no_stop_trim": True, "skip_special_tokens": False}
    if sampling.seed is not None:
        p["sampling_seed"] = int(sampling.seed)
    if sampling.stop and server_stops:
        p["stop"] = list(sampling.stop)
    return p


def parse_generate(out: Any, url: str, tokenizer,
                   expected_version: str | None) -> GenerateOutput:
    """A ``/generate`` answer of the server at ``url`` as a :class:`GenerateOutput`.

    Raises:
        _Transient: the request was aborted (worth another try).
        SGLangServerError: it is stamped with another ``weight_version`` than
            ``expected_version`` (None: not checked).
        EngineRequestError: the answer is not what SGLang's native API returns.
    """
    where = f"{url}/generate"
    if isinstance(out, list) and len(out) == 1:
        out = out[0]
    if not isinstance(out, dict) or "meta_info" not in out or "output_ids" not in out:
        raise EngineRequestError(where, 200, f"expected an object with output_ids and "
                                 f"meta_info (is the server SGLang's native API?); got "
                                 f"{str(out)[:200]}")
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type")
    if kind == "abort":
        raise _Transient(f"{where}: request aborted: {finish.get('message', '')}", url)
    version = meta.get("weight_version")
    if expected_version is not None and version is not None \
            and str(version) != expected_version:
        raise SGLangServerError(f"{where} answered with weight_version {version!r}, but "
                                f"{expected_version!r} was pushed last: another trainer is "
                                f"updating this server, or an update did not reach it",
                                [url])
    ids = [int(t) for t in out["output_ids"]]
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list) or len(lps) != len(ids):
        raise EngineRequestError(where, 200, f"output_token_logprobs has "
                                 f"{len(lps) if isinstance(lps, list) else lps!r} entries "
                                 f"for {len(ids)} output_ids (is return_logprob on?)")
    logprobs = []
    for j, (entry, tok) in enumerate(zip(lps, ids)):
        if int(entry[1]) != tok:
            raise EngineRequestError(where, 200, f"output_token_logprobs[{j}] is for "
                                     f"token {entry[1]}, output_ids[{j}] is {tok}")
        logprobs.append(float(entry[0]))
    tops = meta.get("output_top_logprobs")  # per position [[logprob, id, text], ...]
    tops = None if tops is None else [[(int(t[1]), float(t[0])) for t in row] for row in tops]
    if kind == "length":
        return GenerateOutput(ids, logprobs, "length", None, top_logprobs=tops)
    if kind != "stop":
        raise EngineRequestError(where, 200, f"finish_reason {finish!r}; expected type "
                                 "stop, length or abort")
    matched = finish.get("matched")
    stop_reason = (tokenizer.convert_ids_to_tokens(int(matched))
                   if isinstance(matched, int) else matched)
    return GenerateOutput(ids, logprobs, "stop", stop_reason, top_logprobs=tops)


def client_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(tokens to keep, stop string) for the first token whose decoded tail holds a stop
    string, or None: the HF engine's rule, for servers that cannot apply ``stop``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = (functools.partial(backend.decode, skip_special_tokens=False)
              if backend is not None else
              functools.partial(tokenizer.decode, skip_special_tokens=False))
    for i in range(1, len(ids) + 1):
        tail = decode(ids[max(0, i - STOP_WINDOW):i])
        for s in stops:
            if s in tail:
                return i, s
    return None
