"""Search-R1's instruction prompt (``make_prefix``, template ``base``), verbatim.

Changing this text changes what the policy is trained on: bump the search env's id
version (``agentgym/Search-vN``) when you do.
"""

from __future__ import annotations

TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between "
    "<information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)


#: ``search.protocol=tools``: the same task with the search engine as a function tool
TOOLS_TEMPLATE = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. "
    "After reasoning, if you find you lack some knowledge, you can call the search tool; "
    "its results come back to you. You can search as many times as your want. "
    "If you find no further external knowledge needed, reply without a tool call and give "
    "the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)


def make_tools_prompt(question: str) -> str:
    """The user message for ``question`` under ``search.protocol=tools``."""
    return TOOLS_TEMPLATE.format(question=make_prompt(question).rsplit("Question: ", 1)[1]
                                 .rstrip("\n"))


def make_prompt(question: str) -> str:
    """The user message for ``question``: stripped, with ``?`` appended if missing.

    Raises:
        ValueError: ``question`` is blank.
    """
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    if question[-1] != "?":
        question += "?"
    return TEMPLATE.format(question=question)
