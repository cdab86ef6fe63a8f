"""ReTool's instruction prompt, verbatim.

Source: ReTool (Feng et al., 2025, arXiv:2504.11536). This is the user template of its
cold-start data (``JoeYing/ReTool-SFT``: verl's ``retool_sft_preprocess.py`` splits those
prompts at ``*user question:*``), as carried by verl's ReTool scheduler
(``ci_user_prompt_template_v3``), rendered with single braces around the example answer.
The model writes code as ``<code>`` + a fenced python block + ``</code>``; the sandbox's
output comes back as ``<interpreter>…</interpreter>``; the answer is ``\\boxed{…}``
inside ``<answer>…</answer>``. Two trailing spaces (after "imports." and "format:") are in
the original and kept.

Changing this text changes what the policy is trained on: bump the code env's id version
(``agentgym/Code-vN``) when you do.
"""

from __future__ import annotations

TEMPLATE = (
    "Solve the following problem step by step. You now have the ability to selectively "
    "write executable Python code to enhance your reasoning process. The Python code will "
    "be executed by an external sandbox, and the output (wrapped in "
    "`<interpreter>output_str</interpreter>`) can be returned to aid your reasoning and "
    "help you arrive at the final answer. The Python code should be complete scripts, "
    "including necessary imports. \n"
    "Each code snippet is wrapped with `<code>\n```python\ncode snippet\n```\n</code>`.\n"
    "The last part of your response should be in the following format:\n"
    "<answer>\n\\boxed{'The final answer goes here.'}\n</answer>\n"
    "\n"
    "*user question:*\n"
    "{question}\n"
    "\n"
    "Remember to place the final answer in the last part using the format: \n"
    "<answer>\n\\boxed{'The final answer goes here.'}\n</answer>"
)


#: ``code.protocol=tools``: the same task with the interpreter as a function tool
TOOLS_TEMPLATE = (
    "Solve the following problem step by step. You can call the python tool to run "
    "executable Python code (complete scripts, including necessary imports); its output "
    "comes back to you to aid your reasoning.\n"
    "The last part of your response should be in the following format:\n"
    "<answer>\n\\boxed{'The final answer goes here.'}\n</answer>\n"
    "\n"
    "*user question:*\n"
    "{question}\n"
)


#: the same protocol in fewer words: ``data=arith``'s prompt (agentgym.envs.arith). With
#: smollm2's chat template a prompt is 99 tokens against ReTool's 229; every sample of a
#: group carries it through the update, which on a CPU is most of a GRPO step's time.
SHORT_TEMPLATE = (
    "Solve the problem with Python. Write code as <code>\n```python\ncode\n```\n</code>; "
    "its output comes back in <interpreter>output</interpreter>. End with "
    "<answer>\n\\boxed{answer}\n</answer>.\n\n"
    "Problem: {question}"
)


def make_short_prompt(question: str) -> str:
    """The user message for ``question`` under :data:`SHORT_TEMPLATE`."""
    make_prompt(question)  # the same checks
    return SHORT_TEMPLATE.replace("{question}", question.strip())


def make_tools_prompt(question: str) -> str:
    """The user message for ``question`` under ``code.protocol=tools``."""
    make_prompt(question)  # the same checks
    return TOOLS_TEMPLATE.replace("{question}", question.strip())


def make_prompt(question: str) -> str:
    """The user message for ``question`` (stripped; otherwise unchanged).

    Raises:
        ValueError: ``question`` is blank.
    """
    question = question.strip()
    if not question:
        raise ValueError("question is empty")
    return TEMPLATE.replace("{question}", question)


def code_row(question: str, answer: str, source: str = "builtin",
             extra_info: dict | None = None, prompt=make_prompt) -> dict:
    """A verl-format dataset row for the code env (``prompt``: the user message's maker)."""
    return {"data_source": source, "prompt": [{"role": "user", "content": prompt(question)}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"question": question, **(extra_info or {})}, "env": "code"}
