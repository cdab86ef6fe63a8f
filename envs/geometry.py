"""Geometry with a diagram (Geometry3K, verl's geo3k recipe), ``agentgym/Geometry-v0``.

The first observation is one user message holding the diagram (an image part) and the
question (with its choices when known); the model answers with ``\\boxed{…}``. Reward 1.0
when the boxed answer is right, else 0.0; ``info["em"]`` is that correctness:

- without choices, the answer must equal ``reward_model.ground_truth`` after rounding to
  the gold's stated precision (Geometry3K rounds its answers: ``2\\sqrt{3}`` for
  ``3.46``, ``16.97`` for ``17``, but not ``121`` for ``120``;
  :func:`agentgym.envs.math_reward.matches_rounded`; ``rel_tol`` only absorbs float noise);
  ``60°`` and ``60^\\circ`` read as ``60``;
- with choices (``extra_info.choices`` and ``answer_letter``), a letter answer counts
  when it is the gold letter (``B``, ``(B)``, ``B.``, ``\\text{B}``, ``\\mathrm{B}``,
  ``(B) 6.45``), and a numeric answer when the choice nearest to it is the gold choice
  and it matches that choice as above: with choices 6.4, 6.45, 6.5, 7 and gold B, 6.45
  counts, 6.4 and 6.5 do not.

With ``tool=True`` (``geometry.tool=true``) the env is multi-turn like verl's geo3k tool
example: the model may write ``<calculator>2*sqrt(3)*5</calculator>`` (generation stops
at ``</calculator>``) and gets ``<result>17.3205</result>`` back as a tool message,
until it answers or runs out of turns. The calculator evaluates arithmetic and a few
functions (``sqrt``, ``sin``/``cos``/``tan`` in degrees, ``pi``…) by walking the
expression's syntax tree: nothing is executed.

Rows are verl's format with an ``images`` column (``scripts/build_geometry_data.py``):
the prompt's ``<image>`` marks where the diagram goes, and ``images[0]`` is a path,
``{"bytes": …}``, ``{"path": …}`` or ``{"logic_form": …}`` (drawn on first use,
:mod:`agentgym.envs.geometry_diagrams`).
"""

from __future__ import annotations

import ast
import io
import math
import operator
import re
from dataclasses import dataclass

from agentgym.envs.base import AgentEnv
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.math_reward import (extract_boxed, matches_rounded, numeric_value,
                                       strip_text_macros)
from agentgym.envs.geometry_diagrams import diagram_png

_CALC = re.compile(r"<calculator>(.*?)(?:</calculator>|$)", re.DOTALL)
INSTRUCTION = ("Look at the diagram and answer the question. Think step by step, then put "
               "the final answer in \\boxed{}.")
TOOL_INSTRUCTION = ("You may compute with <calculator>expression</calculator> (e.g. "
                    "<calculator>2*sqrt(3)*5</calculator>; angles in degrees); the result "
                    "comes back as <result>…</result>.")
INVALID_ACTION = ("Your reply has no \\boxed{answer}. Give the final answer as \\boxed{…}.")
# A choice letter: "B", "(b)", "B.", "B)", "B:", "(B) 6.45", "B. 6.45" (after \text{} is peeled)
_LETTER = re.compile(r"\(?([A-Za-z])(?:(?:\)|\.|:)\s*.*)?", re.DOTALL)


def load_image(spec):
    """An ``images`` entry as a PIL image: a path, ``{"path"}``, ``{"bytes"}`` (verl),
    ``{"logic_form"}`` (drawn), or a PIL image."""
    from PIL import Image
    if isinstance(spec, Image.Image):
        return spec.convert("RGB")
    if isinstance(spec, str):
        return Image.open(spec).convert("RGB")
    if isinstance(spec, dict):
        if spec.get("bytes") is not None:
            return Image.open(io.BytesIO(spec["bytes"])).convert("RGB")
        if spec.get("path"):
            return Image.open(spec["path"]).convert("RGB")
        if spec.get("logic_form"):
            return Image.open(diagram_png(spec["logic_form"])).convert("RGB")
    raise ValueError(f"cannot read an image from {str(spec)[:80]!r}; give a path, "
                     "{'path': …}, {'bytes': …} or {'logic_form': …}")


def geometry_row(question: str, answer: str, logic_form: dict, pid: str = "", split: str = "",
                 choices: list[str] | None = None, letter: str | None = None,
                 source: str = "geometry3k") -> dict:
    """A verl-format row: ``<image>`` and the question in the prompt, the diagram's
    annotation in ``images``."""
    text = question
    if choices:
        text += "\nChoices: " + "  ".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices))
    extra = {"id": pid, "split": split, "question": question}
    if choices:
        extra.update(choices=list(choices), answer_letter=letter)
    return {"data_source": source, "ability": "math", "env": "geometry",
            "prompt": [{"role": "user", "content": f"<image>{text}"}],
            "images": [{"logic_form": logic_form}],
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": extra}


#: Used by ``reset()`` without a dataset row (contract checks, smoke tests).
BUILTIN_ROWS = [
    geometry_row("Find x.", "5", {
        "point_positions": {"A": [0, 0], "B": [0, 120], "C": [160, 120]},
        "line_instances": ["AB", "BC", "AC"], "circle_instances": [],
        "diagram_logic_forms": ["Equals(LengthOf(Line(A, B)), 3)",
                                "Equals(LengthOf(Line(B, C)), 4)",
                                "Equals(LengthOf(Line(A, C)), x)",
                                "Perpendicular(Line(A, B), Line(B, C))"]}, "builtin-0"),
    geometry_row("Find m \\angle B.", "60", {
        "point_positions": {"A": [0, 100], "B": [100, 100], "C": [50, 13.4]},
        "line_instances": ["AB", "BC", "AC"], "circle_instances": [],
        "diagram_logic_forms": ["Equals(LengthOf(Line(A, B)), 6)",
                                "Equals(LengthOf(Line(B, C)), 6)",
                                "Equals(LengthOf(Line(A, C)), 6)",
                                "Equals(MeasureOf(Angle(A, B, C)), x)"]}, "builtin-1",
                 choices=["30", "45", "60", "90"], letter="C"),
]


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Pow: operator.pow, ast.Mod: operator.mod}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "log": math.log, "exp": math.exp,
          "sin": lambda d: math.sin(math.radians(d)), "cos": lambda d: math.cos(math.radians(d)),
          "tan": lambda d: math.tan(math.radians(d)),
          "asin": lambda x: math.degrees(math.asin(x)),
          "acos": lambda x: math.degrees(math.acos(x)),
          "atan": lambda x: math.degrees(math.atan(x))}
_NAMES = {"pi": math.pi, "e": math.e}


def calculate(expr: str) -> float:
    """Evaluate an arithmetic expression (module docstring). Raises ValueError."""
    expr = expr.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not expr or len(expr) > 200:
        raise ValueError("give an expression of 1 to 200 characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expr!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
                raise ValueError("exponent or base too large")
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _FUNCS and not node.keywords and len(node.args) == 1:
            return _FUNCS[node.func.id](ev(node.args[0]))
        if isinstance(node, ast.Name) and node.id in _NAMES:
            return _NAMES[node.id]
        raise ValueError(f"only numbers, + - * / ^ and {', '.join(sorted(_FUNCS))}, pi are "
                         f"allowed; got {ast.unparse(node)!r}")

    try:
        value = float(ev(tree))
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        raise ValueError(str(e) or type(e).__name__) from None
    if not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


@dataclass
class GeometryConfig:
    tool: bool = False  # env=geometry: offer a <calculator> tool (multi-turn, as verl's geo3k tool)
    rel_tol: float = 1e-6  # env=geometry: float-noise slack on the gold's rounding (answer check)


class GeometryEnv(AgentEnv, env_id="agentgym/Geometry-v0", short="geometry"):
    """See the module docstring. ``rel_tol``: relative slack for float noise in the
    numeric check (the tolerance itself is the gold's rounding)."""

    observation_format = "chat"

    def __init__(self, max_turns: int | None = None, tool: bool = False,
                 rel_tol: float = 1e-6) -> None:
        super().__init__(max_turns=max_turns)
        self.tool, self.rel_tol = tool, rel_tol
        self.stop_strings = ("</calculator>",) if tool else ()
        self._gold, self._choices, self._letter = "", None, None

    def _reset(self, row):
        row = row or self.pick_row(BUILTIN_ROWS)
        images = row.get("images") or []
        if not images:
            raise ValueError("a geometry row needs an 'images' column with its diagram")
        extra = row.get("extra_info") or {}
        self._gold = str(row["reward_model"]["ground_truth"])
        self._choices, self._letter = extra.get("choices"), extra.get("answer_letter")
        text = row["prompt"][-1]["content"]
        parts, pics = [], iter(images)
        for i, chunk in enumerate(text.split("<image>")):
            if i:
                parts.append({"type": "image", "image": load_image(next(pics))})
            if chunk:
                parts.append({"type": "text", "text": chunk})
        if not any(p["type"] == "image" for p in parts):
            parts.insert(0, {"type": "image", "image": load_image(images[0])})
        instruction = INSTRUCTION + (" " + TOOL_INSTRUCTION if self.tool else "")
        parts.append({"type": "text", "text": "\n\n" + instruction})
        return [*row["prompt"][:-1], {"role": "user", "content": parts}], {}

    def correct(self, answer: str) -> bool:
        """Whether a boxed answer is right (module docstring: by value, or with choices
        by letter or by the nearest choice)."""
        answer = answer.strip()
        if not (self._choices and self._letter):
            return matches_rounded(answer, self._gold, self.rel_tol)
        gold = ord(self._letter.strip().upper()) - 65
        letter = _LETTER.fullmatch(strip_text_macros(answer).strip())
        if letter and 0 <= ord(letter.group(1).upper()) - 65 < len(self._choices):
            return ord(letter.group(1).upper()) - 65 == gold
        value = numeric_value(answer)
        values = [numeric_value(str(c)) for c in self._choices]
        if value is None or not 0 <= gold < len(values) or values[gold] is None:
            return matches_rounded(answer, self._gold, self.rel_tol)  # not a number
        nearest = min((abs(value - v), i) for i, v in enumerate(values) if v is not None)[1]
        return nearest == gold and matches_rounded(answer, str(self._choices[gold]),
                                                   self.rel_tol)

    def _step(self, action, last_turn):
        boxed = extract_boxed(action)
        if boxed is not None and boxed.strip():
            ok = self.correct(boxed)
            return [], float(ok), True, {"em": float(ok), "answer": boxed}
        calc = _CALC.search(action) if self.tool else None
        if calc:
            self.count("tool_calls")
            try:
                result = f"<result>{calculate(calc.group(1)):.6g}</result>"
            except ValueError as e:
                self.count("tool_failures")
                result = f"<result>error: {e}</result>"
            return [{"role": "tool", "content": result}], 0.0, False, {"em": 0.0}
        self.count("malformed_actions")
        return [{"role": "user", "content": INVALID_ACTION}], 0.0, False, {"em": 0.0}


MANIFEST = EnvManifest(
    sections={"geometry": GeometryConfig},
    datasets={"train": "geometry/train.jsonl.gz", "val": "geometry/val.jsonl",
              "test": "geometry/test.jsonl"},
    # an answer, and one retry when it has no \boxed{} (geometry.tool=true: allow more turns)
    presets={"rollout.max_turns": 2, "trainer.eval_data": "test"},
    kwargs=lambda geometry: {"tool": geometry.tool, "rel_tol": geometry.rel_tol},
)
