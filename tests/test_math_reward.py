"""The code env's reward: \\boxed{} extraction and math equivalence (envs/math_reward.py)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from agentgym.envs.math_reward import extract_boxed, is_equivalent, is_risky, normalize


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{72}.", "72"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{{1,2}}", "{1,2}"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),
    ("\\boxed{ 42 }", "42"),
    ("\\boxed{3} and a cut-off \\boxed{\\frac{1}{", "3"),  # unterminated: earlier complete one
    ("\\boxed{\\frac{1}{", None),
    ("no answer here", None),
    ("\\boxed{}", ""),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("pred, gold", [
    # GSM8K-style integers
    ("72", "72"), ("72.0", "72"), ("$72", "72"), ("\\$72", "72"), ("72.00", "72"),
    ("1,000", "1000"), ("1000", "1,000"), ("18 \\text{ dollars}", "18"), ("'72'", "72"),
    ("-3", "-3"),
    # fractions, decimals, radicals
    ("7.5", "\\frac{15}{2}"), ("\\frac{15}{2}", "7.5"), ("\\dfrac{3}{56}", "\\frac{3}{56}"),
    ("0.5", "\\frac12"), ("\\sqrt{12}", "2\\sqrt{3}"), ("11\\sqrt{2}", "11\\sqrt2"),
    ("2^{10}", "1024"), ("10**3", "1000"),
    # MATH-500 answer shapes
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"),  # tuple
    ("[\\pi^2/8, 5\\pi^2/4]", "\\left[ \\frac{\\pi^2}{8}, \\frac{5 \\pi^2}{4} \\right]"),
    ("(-\\infty, 2]", "(-\\infty,2]"),  # interval
    ("-2, 1", "1,-2"), ("\\{1, -2\\}", "1,-2"), ("7, 5, 3", "3, 5, 7"),  # sets
    ("\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}",
     "\\begin{pmatrix} -7 \\\\ 16 \\\\ 5 \\end{pmatrix}"),
    ("x^2 + 2x + 1", "(x+1)^2"), ("6-5i", "6 - 5i"), ("5", "x=5"), ("90", "90^\\circ"),
    ("15\\%", "15"), ("Evelyn", "\\text{Evelyn}"), ("52", "52_8"),
    # AIME: integers, zero-padded in some sources
    ("25", "025"), ("204", "204"),
])
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("73", "72"), ("50", "-50"), ("-50", "50"), ("", "0"), ("   ", "0"),
    ("1,2", "12"),  # a pair is not a thousands separator
    ("(1,2)", "[1,2]"), ("(-\\infty, 2)", "(-\\infty,2]"),  # open vs closed
    ("q - p", "p - q"), ("\\frac{1}{3}", "0.333"), ("2\\sqrt{2}", "2\\sqrt{3}"),
    ("'The final answer goes here.'", "72"),  # copied from ReTool's prompt
])
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


@pytest.mark.parametrize("bad", ["10^{10^{10}}", "9^{9^9}", "9**9**9", "99999999!",
                                 "(10^{10})!", "10^{1000000}", "1" * 400])
def test_pathological_answers_return_quickly(bad):
    assert is_risky(bad)
    t0 = time.perf_counter()
    assert not is_equivalent(bad, "5")
    assert time.perf_counter() - t0 < 1.0


def test_normalize():
    assert normalize(" \\$1,234.50 ") == "1234.5"
    assert normalize("\\left( 3, \\dfrac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"
    assert normalize("90^{\\circ}") == "90"


def test_works_off_the_main_thread():
    # env.step runs in a thread pool; math-verify's signal.alarm timeouts would raise there.
    cases = [("7.5", "\\frac{15}{2}", True), ("\\sqrt{12}", "2\\sqrt{3}", True),
             ("(1,2)", "[1,2]", False), ("\\{1, -2\\}", "1,-2", True)] * 4
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: is_equivalent(c[0], c[1]), cases))
    assert got == [c[2] for c in cases]


def test_non_strings_are_false():
    assert not is_equivalent(None, "1")  # type: ignore[arg-type]
    assert not is_equivalent("1", 1)  # type: ignore[arg-type]
