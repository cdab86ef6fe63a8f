"""The code env's demonstrations for the cold start (:attr:`CodeEnv.demonstrate`): a
GSM8K solution carries its arithmetic as ``<<48/2=24>>``; its lines become up to
``max_cells`` ``<code>`` cells (the line as a comment, each calculation printed), run in the
sandbox; then ``\\boxed{}`` with the answer. A cell must run cleanly and print the
annotated values, else the question is skipped."""

from __future__ import annotations

import re

_CALC = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def _chunks(items: list, k: int) -> list[list]:
    """``items`` in at most ``k`` contiguous, nearly equal chunks."""
    k = max(1, min(k, len(items)))
    size, extra = divmod(len(items), k)
    out, at = [], 0
    for i in range(k):
        n = size + (i < extra)
        out.append(items[at:at + n])
        at += n
    return out


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)]


def code_demo(row: dict, env, max_cells: int = 3) -> dict | None:
    """One code-interpreter demonstration for a GSM8K ``row`` (played through ``env``)."""
    solution = (row.get("extra_info") or {}).get("solution", "")
    if "####" not in solution:
        return None
    body, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    steps = []  # (line without annotations, [(expression, annotated result)])
    for line in body.strip().splitlines():
        calcs = [(m.group(1).strip(), m.group(2).strip()) for m in _CALC.finditer(line)]
        prose = _CALC.sub("", line).strip()
        if prose:
            steps.append((prose, calcs))
    if not any(c for _, c in steps):
        return None
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []
    cells = _chunks(steps, max_cells)
    for k, cell in enumerate(cells):
        lines, expected = [], []
        for prose, calcs in cell:
            lines.append(f"# {prose}")
            for expr, result in calcs:
                lines.append(f"print({expr})")
                expected.append(result)
        lead = "Let me compute this step by step with Python." if k == 0 else \
            "Next, I continue the calculation."
        code = "\n".join(lines)
        action = f"{lead}\n<code>\n```python\n{code}\n```\n</code>"
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            return None
        text = "".join(m["content"] for m in obs)
        if "Error" in text or "Traceback" in text:
            return None
        got = _numbers(text)
        for want in expected:  # every annotated value must be among the printed ones
            w = _numbers(want.replace(",", ""))
            if w and not any(abs(g - w[0]) <= 1e-6 * max(1.0, abs(w[0])) for g in got):
                return None
        actions.append(action)
        observations.append(obs)
    action = f"The final answer is {final}.\n<answer>\n\\boxed{{{final}}}\n</answer>"
    _, reward, terminated, _, _ = env.step(action)
    if not terminated or reward < 1.0:
        return None
    actions.append(action)
    return {"type": "demonstration", "env": "code", "builder": "gsm8k-annotations",
            "prompt": prompt, "actions": actions, "observations": observations,
            "reward": reward, "row": row}


#: env short name -> builder(row, env, **options) -> demonstration or None.
