"""``data=arith``: arithmetic a small model cannot do in its head but can with one line of
Python, in five levels, for the code env (``agentgym/Code-v0``).

    agentgym train env=code data=arith trainer.eval_data=arith_test

=====  ==============================================  ===============================
level  what                                            e.g.
=====  ==============================================  ===============================
1      a product of two 2-digit numbers                What is 47 * 83?
2      3-digit by 2-digit products, sums of four       What is 347 + 589 + 906 + 218?
       3-digit numbers
3      percentages and exact divisions                 What is 35% of 840?
4      two operations                                  What is (347 + 589) * 23?
5      short word problems built on them               A shop packs 36 boxes with 48
                                                       pencils each and sells 275 …
=====  ==============================================  ===============================

Every answer is an integer. A row carries ``extra_info.level`` (what
``data.curriculum=solve_rate`` orders by) and ``extra_info.solution`` in GSM8K's
annotated form (``Pencils left: <<36*48-275=1453>>`` then ``#### 1453``), so the code
env's demonstration builder (:func:`agentgym.envs.code_demos.code_demo`) turns it into a
``print(36*48-275)`` cell with no further code.

The training stream (:func:`train_rows`) is generated from a seed; the held-out set
(``data=arith_test``: :data:`TEST_PER_LEVEL` problems per level, interleaved level by level;
``arith_test_l1`` … ``arith_test_l5`` one level) is shipped in ``data/arith/test.jsonl``,
written by :func:`test_rows` (``python -m agentgym.envs.arith``). The training stream never
holds a held-out question: its generator skips them.
"""

from __future__ import annotations

import json
import random
from typing import Callable

from agentgym.core.paths import data_dir
from agentgym.envs.code_prompt import code_row, make_short_prompt

LEVELS = (1, 2, 3, 4, 5)
TEST_PER_LEVEL = 200
TEST_SEED = 20261126  # the held-out set's seed; training streams use others
TRAIN_PER_LEVEL = 1000
TEST_FILE = "arith/test.jsonl"

Problem = tuple[str, str, str]  # (question, expression, label of the solution line)


def _n(r: random.Random, digits: int) -> int:
    return r.randint(10 ** (digits - 1), 10 ** digits - 1)


def _level1(r: random.Random) -> Problem:
    a, b = _n(r, 2), _n(r, 2)
    return f"What is {a} * {b}?", f"{a}*{b}", "Product"


def _level2(r: random.Random) -> Problem:
    if r.random() < 0.5:
        a, b = _n(r, 3), _n(r, 2)
        return f"What is {a} * {b}?", f"{a}*{b}", "Product"
    xs = [_n(r, 3) for _ in range(4)]
    return f"What is {' + '.join(map(str, xs))}?", "+".join(map(str, xs)), "Sum"


def _level3(r: random.Random) -> Problem:
    if r.random() < 0.5:
        p = r.choice([5, 10, 15, 20, 25, 30, 35, 40, 45, 60, 75, 80])
        base = 20 * r.randint(3, 60)  # a multiple of 20: p% of it is an integer
        return f"What is {p}% of {base}?", f"{base}*{p}//100", "Percentage"
    q, d = _n(r, 3), _n(r, 2)
    return f"What is {q * d} divided by {d}?", f"{q * d}//{d}", "Quotient"


def _level4(r: random.Random) -> Problem:
    kind = r.randrange(3)
    if kind == 0:
        a, b, c = _n(r, 3), _n(r, 3), _n(r, 2)
        return f"What is ({a} + {b}) * {c}?", f"({a}+{b})*{c}", "Result"
    if kind == 1:
        b, c = _n(r, 2), _n(r, 2)
        a = b * c + _n(r, 3)
        return f"What is {a} - {b} * {c}?", f"{a}-{b}*{c}", "Result"
    q, d, c = _n(r, 2), r.randint(12, 48), _n(r, 3)
    return f"What is {q * d} / {d} + {c}?", f"{q * d}//{d}+{c}", "Result"


def _level5(r: random.Random) -> Problem:
    kind = r.randrange(5)
    if kind == 0:
        a, b = _n(r, 2), _n(r, 2)
        c = r.randint(10, a * b - 1)
        return (f"A shop packs {a} boxes with {b} pencils in each box and sells {c} pencils. "
                f"How many pencils are left?", f"{a}*{b}-{c}", "Pencils left")
    if kind == 1:
        a, b, c = _n(r, 2), r.randint(3, 9), _n(r, 3)
        return (f"A car drives {a} km every hour for {b} hours, then {c} km more. How many "
                f"km does it drive in total?", f"{a}*{b}+{c}", "Distance")
    if kind == 2:
        a, b = r.randint(12, 60), r.randint(12, 99)
        pay = a * b + r.randint(1, 500)
        return (f"A school buys {a} books at {b} dollars each and pays with {pay} dollars. "
                f"How many dollars of change does it get?", f"{pay}-{a}*{b}", "Change")
    if kind == 3:
        g, size, c = r.randint(6, 40), r.randint(3, 12), r.randint(12, 48)
        return (f"{g * size} students are split into groups of {size}. Each group needs "
                f"{c} sheets of paper. How many sheets are needed?", f"{g * size}//{size}*{c}",
                "Sheets")
    p = r.choice([10, 15, 20, 25, 30, 40])
    price = 20 * r.randint(3, 50)
    return (f"A jacket costs {price} dollars and is sold at {p}% off. What is the sale price "
            f"in dollars?", f"{price}-{price}*{p}//100", "Sale price")


GENERATORS: dict[int, Callable[[random.Random], Problem]] = {
    1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}


def problem_row(level: int, problem: Problem, split: str, index: int) -> dict:
    """A verl-format code-env row for one generated problem."""
    question, expr, label = problem
    answer = str(eval(expr, {"__builtins__": {}}))  # noqa: S307 - our own digits and operators
    solution = f"{label}: <<{expr}={answer}>>\n#### {answer}"
    return code_row(question, answer, source="arith", prompt=make_short_prompt,
                    extra_info={"level": level, "solution": solution, "split": split,
                                "index": index, "id": f"arith-{split}-L{level}-{index}"})


def _stream(level: int, seed: int, count: int, skip: set[str]) -> list[Problem]:
    r = random.Random(f"arith:{seed}:{level}")
    out, seen = [], set(skip)
    while len(out) < count:
        problem = GENERATORS[level](r)
        if problem[0] not in seen:  # never a held-out question, never one twice
            seen.add(problem[0])
            out.append(problem)
    return out


def interleave(per_level: dict[int, list[dict]]) -> list[dict]:
    """Rows level by level in turn (1, 2, …, 5, 1, 2, …): the first ``k * len(levels)``
    rows hold ``k`` of each level, so ``limit=`` keeps the levels balanced."""
    out = []
    for group in zip(*per_level.values()):
        out.extend(group)
    return out


def test_rows(per_level: int = TEST_PER_LEVEL) -> list[dict]:
    """The held-out set as shipped in ``data/arith/test.jsonl``."""
    return interleave({lv: [problem_row(lv, p, "test", i) for i, p in
                            enumerate(_stream(lv, TEST_SEED, per_level, set()))]
                       for lv in LEVELS})


def shipped_test_rows(level: int | None = None) -> list[dict]:
    """The shipped held-out set (``data/arith/test.jsonl``), or one level of it."""
    with open(data_dir() / TEST_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if level is None or r["extra_info"]["level"] == level]


def heldout_questions() -> set[str]:
    """The questions of the shipped held-out set."""
    return {row["extra_info"]["question"] for row in shipped_test_rows()}


def train_rows(seed: int = 0, per_level: int = TRAIN_PER_LEVEL) -> list[dict]:
    """``per_level`` training problems of each level from ``seed``, interleaved, none of
    them a held-out question (the same ``seed`` gives the same rows)."""
    if seed == TEST_SEED:
        raise ValueError(f"seed {seed} is the held-out set's; use any other")
    skip = heldout_questions()
    return interleave({lv: [problem_row(lv, p, "train", i) for i, p in
                            enumerate(_stream(lv, seed, per_level, skip))] for lv in LEVELS})


if __name__ == "__main__":  # writes the shipped held-out set
    with open(data_dir() / TEST_FILE, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in test_rows())
    print(f"wrote {data_dir() / TEST_FILE}")
