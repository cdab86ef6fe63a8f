"""Math answers: ``\\boxed{}`` extraction and equivalence (the code env's reward).

``is_equivalent(pred, gold)`` is True when any of three checks says so, cheapest first:

1. **normalized strings** are equal (``$``, ``\\text{}``, spaces, ``\\left``/``\\right``,
   ``\\dfrac``→``\\frac``, ``^\\circ``, ``\\%``, thousands commas, trailing ``.0``, leading
   zeros, a trailing ``\\text{ unit}``; see :func:`normalize`);
2. **math-verify** (``parse`` both sides wrapped in ``\\boxed{}``, then ``verify(gold,
   pred)``): fractions vs decimals, radicals, sets, intervals, tuples, matrices, equations;
3. **sympy** on plain arithmetic (digits and ``+-*/^().`` only, never names, since sympy's
   parser calls ``eval``): the difference simplifies to 0. It catches what math-verify
   misreads (``10**3``) and works when math-verify is not installed.

Threads: math-verify's own timeouts use ``signal.alarm``, which raises off the main
thread (``env.step`` runs in a thread pool), so it is always called with
``parsing_timeout=None``/``timeout_seconds=None``. Without those timeouts a pathological
answer could make sympy run for ever (``10^{10^{10}}`` and ``99999999!`` do: sympy
evaluates them exactly), so instead: inputs longer than :data:`MAX_CHARS` are only
string-compared, answers with power towers, huge exponents or large factorials skip the
symbolic checks (:func:`is_risky`), and the symbolic checks run in a helper thread that is
abandoned after :data:`SYMBOLIC_TIMEOUT_S` (verdict False). An abandoned thread keeps
running until sympy returns; the guard makes that rare, not impossible.
"""

from __future__ import annotations

import logging
import re
import threading

logger = logging.getLogger(__name__)

#: Answers longer than this (characters, after extraction) are only string-compared.
MAX_CHARS = 300
#: Seconds the symbolic checks (math-verify, sympy) may take before the verdict is False.
SYMBOLIC_TIMEOUT_S = 10.0

_BOX = re.compile(r"\\(boxed|fbox)\s*(\{)?")
_RISKY = re.compile(
    r"(\^|\*\*)\s*\{[^{}]*(\^|\*\*)"  # a tower: 10^{10^{10}}
    r"|(\^|\*\*)\s*[({]?\s*\d+\s*[)}]?\s*(\^|\*\*)"  # 9^9^9, 9**(9)**9, 10^{10}^{10}
    r"|(\^|\*\*)\s*\{?\s*\(?\s*\d{7,}"  # an exponent of 7+ digits
    r"|(\d{5,}|[)}\]])\s*!")  # 10000!, (10^{10})!


def extract_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{…}`` (or ``\\fbox{…}``) in ``text``.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``); the
    brace-less form ``\\boxed 5`` gives the next token. An unterminated box (generation
    cut mid-answer) is skipped in favour of an earlier complete one. None if there is
    none. The content is stripped (it may be empty).
    """
    found = None
    for m in _BOX.finditer(text):
        if m.group(2) is None:  # "\boxed 5": up to whitespace, '$' or end
            token = re.match(r"[^\s$]+", text[m.end():])
            if token:
                found = token.group(0)
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1].strip()
    return found


def strip_text_macros(s: str) -> str:
    """``\\text{abc}`` → ``abc`` (also ``\\textbf``, ``\\mathrm``, ``\\mbox``,
    ``\\mathbf``; one level of nesting inside is fine)."""
    return re.sub(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{((?:[^{}]|\{[^{}]*\})*)\}",
                  r"\1", s)


def normalize(s: str) -> str:
    """A canonical string form of a math answer, for the exact-match check."""
    s = s.strip()
    s = re.sub(r"\\text\s*\{\s+[a-zA-Z ]*\}\s*$", "", s)  # "18 \text{ dollars}"
    s = strip_text_macros(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[,!;: ]", "", s)  # thin spaces
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    s = s.replace("°", "").replace("\\degree", "")  # 60° and \degree as well as 60^\circ
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = "".join(s.split()).lower()
    s = s.rstrip(".")
    s = re.sub(r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?![\d,])",
               lambda m: m.group(1) + m.group(2).replace(",", ""), s)  # 1,000 → 1000
    s = re.sub(r"(\d+\.\d*?)0+(?!\d)", r"\1", s)  # 7.50 → 7.5, 72.0 → 72.
    s = re.sub(r"(\d)\.(?!\d)", r"\1", s)  # 72. → 72
    s = re.sub(r"(?<![\d.])0+(\d)", r"\1", s)  # 025 → 25
    return s


def _unquote(s: str) -> str:
    # ReTool's prompt shows the answer as \boxed{'…'}; models copy the quotes.
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1].strip()
    return s


def is_risky(s: str) -> bool:
    """True for answers sympy may take unbounded time or memory to evaluate."""
    return len(s) > MAX_CHARS or bool(_RISKY.search(s))


def _math_verify(pred: str, gold: str) -> bool | None:
    """math-verify's verdict, or None if it is unavailable or parsed nothing."""
    try:
        import math_verify
        from math_verify import grader, parser
    except ImportError:
        return None
    # We bound inputs ourselves (module docstring); silence the one-time "timeout is
    # disabled" warning it would print into every CLI run.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    g = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    p = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not g or not p:
        return None
    return bool(math_verify.verify(g, p, timeout_seconds=None))


_ARITH = re.compile(r"^[\d+\-*/^().\s]+$")


def _sympy_arith(pred: str, gold: str) -> bool | None:
    """For plain arithmetic on both sides: whether the values are equal."""
    a, b = (normalize(x).replace("^", "**") for x in (pred, gold))
    if not (_ARITH.match(a) and _ARITH.match(b)):
        return None
    import sympy
    from sympy.parsing.sympy_parser import parse_expr
    try:
        return bool(sympy.simplify(parse_expr(a) - parse_expr(b)) == 0)
    except Exception:  # noqa: BLE001 - any parse/eval failure means "cannot tell"
        return None


def _symbolic(pred: str, gold: str) -> bool:
    verdict = None  # math-verify, then sympy arithmetic
    try:
        verdict = _math_verify(pred, gold)
    except Exception:  # noqa: BLE001 - a grader bug must not kill an episode
        logger.debug("math-verify failed on %r vs %r", pred, gold, exc_info=True)
    return bool(verdict or _sympy_arith(pred, gold))


def is_equivalent(pred: str, gold: str) -> bool:
    """Whether answer ``pred`` is mathematically equivalent to ``gold`` (module docstring).

    Safe to call from any thread; never raises on malformed input.
    """
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    pred, gold = _unquote(pred), _unquote(gold)
    if not pred:
        return False
    if normalize(pred) == normalize(gold):
        return True
    if is_risky(pred) or is_risky(gold):
        return False
    box: list[bool] = []
    worker = threading.Thread(target=lambda: box.append(_symbolic(pred, gold)), daemon=True,
                              name="math-verify")
    worker.start()
    worker.join(SYMBOLIC_TIMEOUT_S)
    if worker.is_alive():
        logger.warning("math equivalence check timed out after %.0fs on %r vs %r",
                       SYMBOLIC_TIMEOUT_S, pred[:80], gold[:80])
        return False
    return bool(box and box[0])


def numeric_value(s: str) -> float | None:
    """The value of an answer that is a number (``2\\sqrt{3}``, ``\\frac{15}{2}``, ``6.45``,
    ``4\\pi``), or None. Bounded like :func:`is_equivalent` (risky input is refused)."""
    if not isinstance(s, str):
        return None
    s = _unquote(s)
    if not s or is_risky(s):
        return None
    try:
        return float(normalize(s))
    except ValueError:
        pass
    try:
        import math_verify
        from math_verify import grader, parser
        parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
        for expr in math_verify.parse(f"\\boxed{{{s}}}", parsing_timeout=None):
            if hasattr(expr, "is_number") and expr.is_number:
                value = complex(expr.evalf())
                if abs(value.imag) < 1e-12:
                    return float(value.real)
    except Exception:  # noqa: BLE001 - cannot evaluate: not a number
        logger.debug("no numeric value for %r", s, exc_info=True)
    return None


_DECIMAL = re.compile(r"[-+]?(?:(\d+)(?:\.(\d*))?|\.(\d+))")


def _decimal_literal(s: str) -> re.Match | None:
    """``s`` as a plain decimal number (``"120"``, ``"3.46"``, ``"60^\\circ"``), or None."""
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree|\\?%|\$|\s", "", _unquote(s))
    return _DECIMAL.fullmatch(s)


def decimal_places(s: str) -> int | None:
    """How many decimals a plain decimal answer states (``"120"`` → 0, ``"3.46"`` → 2,
    ``"7.50"`` → 2); None when ``s`` is not a plain decimal (``2\\sqrt{3}``, ``x+1``)."""
    m = _decimal_literal(s) if isinstance(s, str) else None
    if m is None:
        return None
    return len(m.group(2) or m.group(3) or "")


def _significant_digits(s: str) -> int:
    m = _decimal_literal(s)
    digits = (m.group(1) or "") + (m.group(2) or m.group(3) or "")
    return len(digits.lstrip("0"))


def matches_rounded(pred: str, gold: str, rel_tol: float = 1e-6) -> bool:
    """Whether ``pred`` is ``gold``, allowing for the rounding of Geometry3K's answers.

    Geometry3K states answers rounded (``3.46`` for ``2\\sqrt{3}``), so besides
    :func:`is_equivalent` a numeric ``pred`` counts when it equals the gold after
    rounding to the gold's stated precision: ``|pred - gold| <= 0.5 * 10**-d`` where
    ``d`` is the gold's number of decimals (``2\\sqrt{3}`` for ``3.46``, ``16.97`` for
    ``17``, but not ``121`` for ``120``). When the gold is exact (``2\\sqrt{3}``,
    ``\\frac{15}{2}``, ``4\\pi``), a plain decimal ``pred`` with at least 3 significant
    digits counts when it is the gold rounded to the pred's own decimals (``3.46`` for
    ``2\\sqrt{3}``; ``3`` or ``3.5`` do not). ``rel_tol`` (times ``max(|gold|, 1)``) is
    added to absorb float noise only.
    """
    if is_equivalent(pred, gold):
        return True
    a, b = numeric_value(pred), numeric_value(gold)
    if a is None or b is None:
        return False
    slack = rel_tol * max(abs(b), 1.0)
    places = decimal_places(gold)
    if places is None and decimal_places(pred) is not None and _significant_digits(pred) >= 3:
        places = decimal_places(pred)
    half_unit = 0.5 * 10.0 ** -places if places is not None else 0.0
    return abs(a - b) <= half_unit + slack
