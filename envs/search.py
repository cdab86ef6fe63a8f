"""Search-augmented QA (Search-R1 protocol), ``agentgym/Search-v0``.

The model reasons in ``<think>``, queries with ``<search>q</search>``, receives
``<information>Doc 1(Title: t) text …</information>`` appended inline, and ends with
``<answer>a</answer>``. Reward: normalized exact match against the row's
``reward_model.ground_truth.target`` (``reward="em"``, Search-R1's), or the token F1 of the
answer (``reward="f1"``: partial credit, so more groups have reward variance); both are
reported as metrics. With ``format_reward > 0`` a well-formed answer earns at least that
much (an episode with any malformed action earns only its score). A search on the last allowed turn ends the episode as
truncated; a retriever failure becomes an ``<information>`` observation saying so.

Turn reward (off by default): with ``retrieval_reward > 0``, the first search of an episode
whose results hold a gold answer (what ``answer_seen`` counts) earns that much on its turn,
for turn-level credit (``algo.advantage=mt_grpo|gigpo``, :mod:`agentgym.trainers.turn_credit`). Paid
once per episode, so repeating a good search earns nothing more; the episode's return is
the retrieval reward plus the answer's.

Hop reward (off by default, multi-hop rows, :mod:`agentgym.envs.multihop`): with
``hop_reward > 0``, a search whose results bring a gold paragraph of the row
(``extra_info.gold_paragraphs``) not retrieved before in the episode earns ``hop_reward``
per such paragraph on its turn: at most once per paragraph, so a two-hop question pays at
most twice, whatever the searches. ``hop_reward_from=2`` pays only the paragraphs a
search after the first brings (the second hop itself: a first search that brings both
earns nothing). The counter ``gold_retrieved`` (in ``info``, multi-hop
rows only) counts them; the step's ``info["gold_hits"]`` lists the gold paragraphs (hop
indices) among its results. The outcome reward stays EM or F1.

Multi-hop episode metrics (multi-hop rows only, whatever ``hop_reward``): ``gold_retrieved``
(0-2, the gold paragraphs the episode's searches brought) and ``second_hop`` (1 when the
episode's second search brought the gold paragraph still missing, so that after it both
were retrieved: the second hop done by a second search; 0 for an episode with fewer than
two searches, or whose first search already brought both). A search on the last turn is
not run (tags protocol) and does not count as the second.

Corpus (``retriever.corpus``, local server only): ``wiki`` (the shipped 21k passages),
``multihop`` (those plus HotpotQA's paragraphs, ``data/multihop/corpus.jsonl.gz``), or
``auto`` (multihop when the run's data or held-out set is a multi-hop dataset, else wiki).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from agentgym.core.registry import check_choices
from agentgym.envs.base import AgentEnv
from agentgym.envs.function_calling import CallError, function_tool, parse_tool_calls, tool_message
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.multihop import MULTIHOP_DATASETS, gold_hits, gold_paragraphs, multihop_rows
from agentgym.envs.rewards import contains_answer, exact_match, f1_score, gold_answers
from agentgym.envs.search_demos import search_demo
from agentgym.envs.search_prompt import make_prompt, make_tools_prompt
from agentgym.core.paths import file_digest, shipped_corpus
from agentgym.envs.answerable import answerable, difficulty_levels
from agentgym.tools.errors import ToolBadRequest, ToolError

logger = logging.getLogger(__name__)

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_END_TOKEN = re.compile(r"(<\|[\w]+\|>|</s>|<eos>)\s*$")  # the EOS that ended the turn
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query "
                  "between <search> and </search>. If I want to give the final answer, I should "
                  "put the answer between <answer> and </answer>. Let me try again.\n")

#: Used by ``reset()`` without a dataset row (contract checks, smoke tests).
BUILTIN_QUESTIONS = [
    ("who wrote the declaration of independence", ["Thomas Jefferson"]),
    ("what is the capital of australia", ["Canberra"]),
    ("who painted the mona lisa", ["Leonardo da Vinci"]),
    ("how many planets are in the solar system", ["eight", "8"]),
]


def search_row(question: str, answers: list[str], source: str = "builtin") -> dict:
    """A verl-format dataset row for the search env."""
    return {"data_source": source, "prompt": [{"role": "user", "content": make_prompt(question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(answers)}},
            "extra_info": {"question": question}, "env": "search"}


def parse_action(text: str) -> tuple[str | None, str]:
    """The first ``<search>``/``<answer>`` block: ``("search"|"answer"|None, content)``."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else (None, "")


@dataclass
class RetrieverConfig:
    url: str = ""  # a running Search-R1 /retrieve server; empty starts a local one
    index: str = ""  # local server: a saved index dir (`agentgym index build`); empty = BM25 of data/corpus
    corpus: str = "auto"  # local server's shipped corpus: wiki | multihop | auto (by the data)
    topk: int = 3
    timeout: float = 5.0
    max_restarts: int = 5  # local server: restarts by its supervisor within 10 minutes before the run stops

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"retriever.max_restarts must be >= 0, got {self.max_restarts}")
        check_choices("retriever", self, {"corpus": ("auto", "wiki", "multihop")})


@dataclass
class SearchConfig:
    format_reward: float = 0.0  # reward for a well-formed but wrong answer (env=search)
    reward: str = "em"  # em (exact match, Search-R1) | f1 (token F1: partial credit)
    protocol: str = "tags"  # tags (Search-R1's <search> text) | tools (a search function, Hermes <tool_call>)
    retrieval_reward: float = 0.0  # turn reward: the first search whose results hold a gold answer (0 = off)
    hop_reward: float = 0.0  # turn reward per gold paragraph a search brings first (0 = off)
    hop_reward_from: int = 1  # the first search (1-based) whose new gold paragraphs earn hop_reward

    def __post_init__(self) -> None:
        check_choices("search", self, {"reward": ("em", "f1"), "protocol": ("tags", "tools")})
        for name in ("retrieval_reward", "hop_reward"):
            if getattr(self, name) < 0:
                raise ValueError(f"search.{name} must be >= 0, got {getattr(self, name)}")
        if self.hop_reward_from < 1:
            raise ValueError(f"search.hop_reward_from must be >= 1 (1: every search, 2: "
                             f"the searches after the first), got {self.hop_reward_from}")


class SearchEnv(AgentEnv, env_id="agentgym/Search-v0", short="search"):
    """Search-R1 environment.

    Args:
        retriever_url: Search-R1-compatible ``/retrieve`` endpoint. None starts a local
            BM25 server over the shipped corpus on first use.
        topk: passages per search.
        max_turns: actions per episode (searches plus the answer).
        format_reward: reward for a well-formed but wrong answer (0 disables).
        reward: ``em`` (exact match, 0 or 1) or ``f1`` (token F1, partial credit).
        retrieval_reward: turn reward of the first search whose results hold a gold answer
            (0 disables; module docstring).
        hop_reward: turn reward per gold paragraph of a multi-hop row that a search brings
            for the first time in the episode (0 disables; module docstring).
        hop_reward_from: the episode's first search (1-based) whose new gold paragraphs
            earn ``hop_reward`` (2: only the second hop's).
        corpus: without ``retriever_url``/``retriever``: the shipped corpus the local
            server indexes (``wiki`` or ``multihop``).
        timeout: seconds per retrieval request.
        retriever: an object with ``retrieve(list[str]) -> list[list[dict]]``; overrides
            ``retriever_url`` (used by tests to inject faults).
        protocol: ``tags`` (Search-R1's ``<search>`` / ``<information>`` text) or ``tools``
            (a ``search`` function tool: Hermes ``<tool_call>`` blocks, any number per turn,
            each answered by a ``tool`` message; a turn without a call is the answer, its
            ``<answer>`` content if it has one, else its text without ``<think>``).
    """

    observation_format = "inline"
    stop_strings = ("</search>", "</answer>")
    #: a multi-hop row's episode reports these (module docstring); others the manifest's
    multihop_metrics = ("answer_seen", "gold_retrieved", "second_hop")

    def __init__(self, retriever_url: str | None = None, topk: int = 3,
                 max_turns: int | None = None,
                 format_reward: float = 0.0, timeout: float = 5.0, retriever=None,
                 reward: str = "em", protocol: str = "tags",
                 retrieval_reward: float = 0.0, hop_reward: float = 0.0,
                 corpus: str = "wiki", hop_reward_from: int = 1) -> None:
        super().__init__(max_turns=max_turns)
        for name, value in (("retrieval_reward", retrieval_reward), ("hop_reward", hop_reward)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if hop_reward_from < 1:
            raise ValueError(f"hop_reward_from must be >= 1, got {hop_reward_from}")
        if corpus not in ("wiki", "multihop"):
            raise ValueError(f"corpus={corpus!r}; valid: wiki, multihop")
        self.retrieval_reward, self.hop_reward, self.corpus = retrieval_reward, hop_reward, corpus
        self.hop_reward_from = hop_reward_from
        if protocol not in ("tags", "tools"):
            raise ValueError(f"search.protocol={protocol!r}; valid: tags, tools")
        self.protocol = protocol
        if protocol == "tools":
            self.tools = [function_tool("search", "Search Wikipedia; returns the top passages.",
                                        {"query": {"type": "string",
                                                   "description": "what to look up"}})]
            self.observation_format, self.stop_strings = "chat", ()
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        if reward not in ("em", "f1"):
            raise ValueError(f"reward={reward!r}; valid: em, f1")
        self.reward = reward
        self.topk, self.timeout, self.format_reward = topk, timeout, format_reward
        self._url = retriever_url
        self._retriever = retriever
        self._owns_retriever = retriever is None
        self._targets: list[str] = []
        self._golds: list[dict] = []  # the row's gold paragraphs (multi-hop rows), hop order
        self._found: set[int] = set()  # of them, the ones retrieved so far this episode
        self._searches = 0  # searches run this episode (counted for second_hop)
        self._well_formed = True

    def _client(self):
        if self._retriever is None:
            from agentgym.tools.retriever import RetrieverClient  # lazy: loads httpx
            url = self._url
            if url is None:
                # lazy: loads httpx
                from agentgym.tools.local_retriever import ensure_local_retriever
                url = ensure_local_retriever(shipped_corpus(self.corpus))
            self._retriever = RetrieverClient(url, topk=self.topk, timeout=self.timeout)
        return self._retriever

    def _reset(self, row):
        if row is None:
            q, a = BUILTIN_QUESTIONS[int(self.np_random.integers(len(BUILTIN_QUESTIONS)))]
            row = search_row(q, a)
        self._targets = gold_answers(row)
        self._golds, self._found, self._searches = gold_paragraphs(row), set(), 0
        if self._golds:  # reported from the first info on, as answer_seen is
            self.episode_metrics = self.multihop_metrics
            self.count("gold_retrieved", 0)
            self.count("second_hop", 0)
        if self.protocol == "tools":  # the row's prompt teaches the tags; ask for tool calls
            question = (row.get("extra_info") or {}).get("question")
            if question:
                row = {**row, "prompt": [{"role": "user", "content": make_tools_prompt(question)}]}
        self._well_formed = True
        self._seen = False  # has a search result held a gold answer (counter answer_seen)?
        self.count("answer_seen", 0)
        return [dict(m) for m in row["prompt"]], {"ground_truth": self._targets}

    def _step(self, action, last_turn):
        if self.protocol == "tools":
            return self._tools_step(action, last_turn)
        kind, content = parse_action(action)
        if kind == "answer":
            em, f1 = exact_match(content, self._targets), f1_score(content, self._targets)
            score = em if self.reward == "em" else f1
            reward = max(score, self.format_reward) if self._well_formed else score
            return [], reward, True, {"em": em, "f1": f1, "answer": content}
        if kind == "search" and content:
            self.count("tool_calls")
            if last_turn:  # no turn left to use the result
                return [], 0.0, False, {"em": 0.0, "f1": 0.0}
            text, docs = self._search(content)
            reward, info = self._retrieved(text, docs)
            return [self._tool_message(text)], reward, False, info
        self._well_formed = False
        self.count("malformed_actions")
        return [{"role": "tool", "content": INVALID_ACTION}], 0.0, False, {}

    def _tools_step(self, action: str, last_turn: bool):
        calls = parse_tool_calls(action, self.tools)
        if not calls:  # no call: this turn is the answer
            kind, content = parse_action(action)
            answer = content if kind == "answer" else \
                _END_TOKEN.sub("", _THINK.sub("", action)).strip()
            em, f1 = exact_match(answer, self._targets), f1_score(answer, self._targets)
            score = em if self.reward == "em" else f1
            reward = max(score, self.format_reward) if self._well_formed else score
            return [], reward, True, {"em": em, "f1": f1, "answer": answer}
        messages, reward, hits = [], 0.0, set()
        for call in calls:
            if isinstance(call, CallError):
                self._well_formed = False
                self.count("malformed_actions")
                messages.append(tool_message(call.name or "error", f"Error: {call.message}"))
                continue
            self.count("tool_calls")
            text, docs = self._search(call.arguments["query"]) \
                if call.arguments["query"].strip() else ("Error: the query is empty.\n", [])
            earned, info = self._retrieved(text, docs)
            reward, hits = reward + earned, hits | set(info.get("gold_hits", ()))
            messages.append(tool_message("search", text))
        if last_turn:  # no turn left to use the results
            return [], 0.0, False, {"em": 0.0, "f1": 0.0}
        return messages, reward, False, ({"gold_hits": sorted(hits)} if hits else {})

    def _retrieved(self, text: str, docs: list[dict]) -> tuple[float, dict]:
        """Note what search results (``text``, their ``docs``) brought; ``(the turn reward
        they earn, step info)``: ``retrieval_reward`` the first time in an episode they
        hold a gold answer, plus ``hop_reward`` per gold paragraph not retrieved before."""
        reward, info = 0.0, {}
        if not self._seen and contains_answer(text, self._targets):
            self._seen = True  # the episode's counters report it from here on
            self.count("answer_seen")
            reward += self.retrieval_reward
        if self._golds:
            self._searches += 1
            hits = gold_hits(docs, self._golds)
            new = set(hits) - self._found
            if hits:
                info["gold_hits"] = hits
            if new:
                self._found |= new
                self.count("gold_retrieved", len(new))
                if self._searches >= self.hop_reward_from:
                    reward += self.hop_reward * len(new)
                if self._searches == 2 and len(self._found) == len(self._golds):
                    self.count("second_hop")  # the second search completed the pair
        return reward, info

    def _search(self, query: str) -> tuple[str, list[dict]]:
        """The passages for ``query`` as the observation's text, and as the retriever
        returned them (``[]`` when the search failed)."""
        from agentgym.tools.retriever import format_docs  # lazy: loads httpx
        try:
            docs = self._client().retrieve([query])[0]
        except ToolError as e:
            self.count("tool_failures")
            if not isinstance(e, ToolBadRequest):  # a 4xx is the query's fault, the rest not
                self.infra_failure(f"search: {type(e).__name__}: {e}")
            logger.warning("search failed (%s): %s", type(e).__name__, e)
            return f"Search failed ({type(e).__name__}): {e}. Try again or answer.\n", []
        return format_docs(docs), docs

    @staticmethod
    def _tool_message(text: str) -> dict:
        return {"role": "tool", "content": f"\n\n<information>{text}</information>\n\n"}

    def close(self) -> None:
        if self._owns_retriever and self._retriever is not None:
            self._retriever.close()
            self._retriever = None
        super().close()


# -- what the trainer asks of the search env (envs.manifest) -------------------------------
def corpus_name(corpus: str, data_name: str, eval_data: str) -> str:
    """The shipped corpus the local retriever indexes: ``corpus`` (``retriever.corpus``);
    ``auto``: multihop when ``data_name`` or ``eval_data`` (``data.name``,
    ``trainer.eval_data``) names a multi-hop dataset, else wiki."""
    if corpus != "auto":
        return corpus
    names = {data_name, *str(eval_data).split(",")}
    return "multihop" if names & set(MULTIHOP_DATASETS) else "wiki"


def answerable_filter(answerable_only: bool, retriever: RetrieverConfig) -> str | None:
    """With ``data.answerable_only`` and the shipped corpus: the questions one of whose
    gold answers the corpus holds (:mod:`agentgym.envs.answerable`; with
    ``retriever.url`` / ``retriever.index`` their presence is unknown)."""
    if not answerable_only:
        return None
    if retriever.url or retriever.index:
        logger.info("data.answerable_only applies to the shipped corpus; with retriever.url"
                    "/retriever.index every question is used")
        return None
    return "have a gold answer in the corpus (data.answerable_only=true)"


def answerable_rows(rows: list[dict], limit: int, retriever: RetrieverConfig, data_name: str,
                    eval_data: str, curriculum: str) -> tuple[list[dict], int]:
    """The answerable rows (the first ``limit``); with a ``curriculum`` each gets its
    difficulty as ``extra_info.level`` (:func:`agentgym.envs.answerable.difficulty_levels`),
    which the curriculum orders by."""
    corpus = shipped_corpus(corpus_name(retriever.corpus, data_name, eval_data))
    kept = [row for row, ok in zip(rows, answerable(rows, corpus)) if ok]
    if not kept:
        raise ValueError("no question has a gold answer in the shipped corpus; set "
                         "data.answerable_only=false to use them anyway")
    found, kept = len(kept), kept[:limit] if limit else kept
    if curriculum:
        kept = [{**row, "extra_info": {**row.get("extra_info", {}), "level": level}}
                for row, level in zip(kept, difficulty_levels(kept, corpus))]
    return kept, found


def search_kwargs(search: SearchConfig, retriever: RetrieverConfig, data_name: str,
                  eval_data: str) -> dict:
    """``search.*`` and ``retriever.*``; without ``retriever.url`` a local server is
    started (once per process) over ``retriever.index`` or the shipped corpus
    (:func:`corpus_name`)."""
    url, r = retriever.url, retriever
    corpus = corpus_name(r.corpus, data_name, eval_data)
    if not url:
        from agentgym.tools.local_retriever import ensure_local_retriever  # lazy: loads httpx
        if r.index:
            url = ensure_local_retriever(index_dir=r.index, max_restarts=r.max_restarts)
        else:
            url = ensure_local_retriever(shipped_corpus(corpus), max_restarts=r.max_restarts)
        logger.info("started local retriever at %s", url)
    return {"retriever_url": url, "topk": r.topk, "timeout": r.timeout,
            "format_reward": search.format_reward, "reward": search.reward,
            "protocol": search.protocol, "retrieval_reward": search.retrieval_reward,
            "hop_reward": search.hop_reward, "hop_reward_from": search.hop_reward_from,
            "corpus": corpus}


def search_sources(search: SearchConfig, retriever: RetrieverConfig, data_name: str,
                   eval_data: str) -> dict:
    """The corpus (its bytes, when shipped) or the server, and what scores answers."""
    r = retriever
    corpus = "" if (r.url or r.index) else \
        file_digest(shipped_corpus(corpus_name(r.corpus, data_name, eval_data)))
    return {"url": r.url, "index": r.index, "corpus": corpus, "topk": r.topk,
            "format_reward": search.format_reward, "reward": search.reward}


MANIFEST = EnvManifest(
    sections={"search": SearchConfig, "retriever": RetrieverConfig},
    reads={"data_name": "data.name", "eval_data": "trainer.eval_data",
           "answerable_only": "data.answerable_only", "curriculum": "data.curriculum",
           "max_searches": "sft.max_searches"},
    default=True,  # agentgym train without env= plays search (Search-R1's budgets: defaults)
    datasets={"train": "search/train.jsonl", "nq": "search/nq_eval.jsonl",
              "hotpotqa": "search/hotpotqa_eval.jsonl",
              "multihop": "multihop/train.jsonl.gz", "multihop_test": "multihop/test.jsonl",
              "multihop_curriculum": multihop_rows},
    kwargs=search_kwargs,
    row_filter=answerable_filter,
    filter_rows=answerable_rows,
    demonstrate=search_demo,  # the cold start's demonstrations
    demo_options=lambda max_searches: {"max_searches": max_searches},
    demo_requires={"search.protocol": "tags"},  # the builder writes the text tags
    sources=search_sources,
    episode_metrics=("answer_seen",),  # a search result held a gold answer
    tool_calls_label="searches",
)
