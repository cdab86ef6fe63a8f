"""A model-judged reward: a model behind an OpenAI-compatible ``/v1/chat/completions``
endpoint grades each episode's answer against the reference.

``reward=judge judge.url=http://host:port`` (any OpenAI-compatible server: vLLM, SGLang,
``agentgym serve``) replaces the env's reward at the end of each episode
(:class:`~agentgym.envs.plugins.RewardOverride`) with the judge's score scaled to [0, 1]:

- the prompt: ``judge.rubric`` (text, or a path to a text file; default :data:`RUBRIC`) as
  the system message, then the question (the row's ``extra_info.question``, if any), the
  reference answer and the response;
- the score: the last ``Score: N`` in the reply, clipped to ``[0, judge.scale]`` and
  divided by it;
- ``judge.timeout_s`` per request; ``judge.retries`` more attempts after a connection
  error, a timeout or a 429/5xx, with exponential backoff; ``judge.max_concurrency``
  requests in flight per process (the env workers share it);
- a reply without a score, a 4xx, or a server still failing after the retries is a
  :class:`JudgeError`: the episode scores 0 and says why (``info["reward_error"]``, the
  ``reward_failures`` counter, a logged warning); the run goes on.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RUBRIC = ("You grade answers to questions. Compare the response's final answer with the "
          "reference answer: same meaning scores high, a wrong or missing answer scores 0. "
          "Reply with one line: 'Score: N', N from 0 to {scale}.")
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_RETRY_STATUS = {429, 500, 502, 503, 504}
_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()


class JudgeError(RuntimeError):
    """The judge gave no usable score; the message says why."""


def parse_score(reply: str, scale: float) -> float:
    """The last ``Score: N`` of ``reply``, clipped to ``[0, scale]``, divided by ``scale``."""
    found = _SCORE.findall(reply or "")
    if not found:
        raise JudgeError(f"no 'Score: N' in the judge's reply: {reply[:200]!r}")
    return min(max(float(found[-1]), 0.0), scale) / scale


@dataclass(frozen=True)
class JudgeReward:
    """A reward function of verl's signature that asks the judge (picklable: each process
    opens its own connection pool on first use)."""

    url: str
    model: str = ""
    rubric: str = ""
    scale: float = 10.0
    timeout_s: float = 30.0
    retries: int = 2
    max_concurrency: int = 8
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"judge.url={self.url!r}: an http(s) URL of an OpenAI-compatible "
                             f"server (it gets /v1/chat/completions) is needed for reward=judge")
        if self.scale <= 0 or self.retries < 0 or self.max_concurrency < 1:
            raise ValueError(f"judge.scale must be > 0, judge.retries >= 0 and "
                             f"judge.max_concurrency >= 1; got {self.scale}, {self.retries}, "
                             f"{self.max_concurrency}")

    @property
    def name(self) -> str:
        return f"judge at {self.url}"

    def messages(self, question: str, reference, response: str) -> list[dict]:
        rubric = self.rubric
        if rubric and Path(rubric).is_file():
            rubric = Path(rubric).read_text()
        system = (rubric or RUBRIC).replace("{scale}", f"{self.scale:g}")
        ref = reference if isinstance(reference, str) else ", ".join(map(str, reference or []))
        user = (f"Question: {question}\n\n" if question else "") + \
            f"Reference answer: {ref}\n\nResponse:\n{response}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def __call__(self, data_source, solution_str, ground_truth, extra_info=None) -> float:
        question = (extra_info or {}).get("question", "") if isinstance(extra_info, dict) else ""
        body = {"messages": self.messages(str(question), ground_truth, solution_str),
                "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        return parse_score(self._ask(body), self.scale)

    def _ask(self, body: dict) -> str:
        import httpx
        with _semaphore(self.url, self.max_concurrency):
            last = ""
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
                try:
                    r = _client(self.timeout_s).post(
                        f"{self.url.rstrip('/')}/v1/chat/completions", json=body)
                except httpx.TimeoutException:
                    last = f"timed out after {self.timeout_s:g} s"
                    continue
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                    continue
                if r.status_code in _RETRY_STATUS:
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                    continue
                if r.status_code >= 400:
                    raise JudgeError(f"the judge refused the request: HTTP {r.status_code}: "
                                     f"{r.text[:300]}")
                try:
                    return r.json()["choices"][0]["message"]["content"] or ""
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    raise JudgeError(f"not an OpenAI chat completion: {r.text[:200]!r}") from e
            raise JudgeError(f"judge at {self.url} failed {self.retries + 1} times; last: {last}")


def _semaphore(url: str, n: int) -> threading.BoundedSemaphore:
    with _SEMAPHORES_LOCK:
        return _SEMAPHORES.setdefault((url, n), threading.BoundedSemaphore(n))


_CLIENTS: dict[float, object] = {}


def _client(timeout_s: float):
    """One connection pool per process and timeout (httpx clients are thread-safe)."""
    import atexit

    import httpx
    with _SEMAPHORES_LOCK:
        if timeout_s not in _CLIENTS:
            _CLIENTS[timeout_s] = client = httpx.Client(timeout=timeout_s)
            atexit.register(client.close)
        return _CLIENTS[timeout_s]


@dataclass
class JudgeConfig:
    """``judge.*`` (``reward=judge``): the judge's server and how it grades (module
    docstring); a section of :class:`agentgym.config.Config`."""

    url: str = ""  # the server (gets /v1/chat/completions): vLLM, SGLang, `agentgym serve`
    model: str = ""  # the "model" field sent ("" = leave it out: the server's only model)
    rubric: str = ""  # system prompt text or a file of it; "" = RUBRIC
    scale: float = 10.0  # the reply's "Score: N" runs 0..scale; the reward is N / scale
    timeout_s: float = 30.0
    retries: int = 2  # more attempts after connection errors, timeouts and 429/5xx
    max_concurrency: int = 8  # requests in flight per process
    max_tokens: int = 64  # the judge's reply budget


def from_config(cfg) -> JudgeReward:
    """``reward=judge``'s function from the ``judge.*`` keys."""
    j = cfg.judge
    return JudgeReward(url=j.url, model=j.model, rubric=j.rubric, scale=j.scale,
                       timeout_s=j.timeout_s, retries=j.retries,
                       max_concurrency=j.max_concurrency, max_tokens=j.max_tokens)
