"""The paired test behind learning claims: exact McNemar on per-question outcomes, and
`agentgym compare` on two `agentgym eval ... out=` files."""

from __future__ import annotations

import json

import pytest

from agentgym.cli import main as cli
from agentgym.reporting.stats import exact_binomial_two_sided, mcnemar


def test_exact_binomial_matches_hand_computed_tails():
    # 2 of 12 discordant pairs: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12
    assert exact_binomial_two_sided(2, 12) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert exact_binomial_two_sided(10, 12) == exact_binomial_two_sided(2, 12)
    assert exact_binomial_two_sided(3, 6) == 1.0  # a tie is capped at 1
    assert exact_binomial_two_sided(0, 0) == 1.0
    # all 6 discordant pairs one way: 2 / 64
    assert exact_binomial_two_sided(6, 6) == pytest.approx(2 / 64)


def test_mcnemar_counts_only_discordant_pairs():
    ids = [f"q{i}" for i in range(20)]
    before = {q: i < 5 for i, q in enumerate(ids)}  # q0..q4 right
    after = {q: 1 <= i < 13 for i, q in enumerate(ids)}  # lost q0, gained q5..q12
    r = mcnemar(before, after)
    assert (r.n, r.gained, r.lost) == (20, 8, 1)
    assert r.before == 0.25 and r.after == 0.6
    assert r.delta == pytest.approx(0.35)
    assert r.p_value == pytest.approx(exact_binomial_two_sided(1, 9))
    assert r.p_value < 0.05


def test_mcnemar_refuses_different_questions():
    with pytest.raises(ValueError, match="different questions.*q9"):
        mcnemar({"q1": True, "q2": False}, {"q1": True, "q9": False})


def _eval_file(path, outcomes):
    path.write_text(json.dumps({"n": len(outcomes), "episodes": [
        {"uid": q, "em": float(ok), "f1": float(ok), "reward": float(ok), "format_valid": True}
        for q, ok in outcomes.items()]}))
    return str(path)


def test_compare_command_prints_the_paired_result(tmp_path, capsys):
    a = _eval_file(tmp_path / "a.json", {f"q{i}": i < 2 for i in range(30)})
    b = _eval_file(tmp_path / "b.json", {f"q{i}": i < 12 for i in range(30)})
    assert cli(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "em on 30 shared questions: 0.067 -> 0.400 (+33.3 points)" in out
    assert "gained 10, lost 0" in out
    assert f"p = {exact_binomial_two_sided(10, 10):.4g}" in out


def test_compare_command_rejects_bad_input(tmp_path, capsys):
    a = _eval_file(tmp_path / "a.json", {"q0": True})
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"n": 1, "em": 1.0}))
    assert cli(["compare", a]) == 2
    assert "usage: agentgym compare" in capsys.readouterr().err
    assert cli(["compare", a, a, "metric=reward"]) == 2
    assert cli(["compare", a, str(old)]) == 2
    assert "has no per-question episodes" in capsys.readouterr().err
