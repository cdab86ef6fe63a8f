"""The code-interpreter env (ReTool protocol), its shipped data and its CLI path.

Episodes are scripted: the "model outputs" below are FAKE, hand-written actions; the code
in them runs in the REAL local sandbox (skipped where it cannot start, e.g. not root)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gymnasium
import pytest

from agentgym import envs
from agentgym.data.rows import load_rows
from agentgym.envs.code import (INVALID_ACTION, NO_CODE, CodeEnv, code_row, parse_action,
                                truncate_utf8)
from agentgym.envs.math_reward import _symbolic, is_equivalent
from agentgym.tools.sandbox import ExecResult, Limits, Sandbox

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
ROW = code_row("Tom has 3 boxes of 12 apples and eats 5. How many are left?", "31")


@pytest.fixture(scope="module")
def sandbox():
    from agentgym.tools.sandbox import LocalSandbox
    try:
        box = LocalSandbox(Limits(cpu_s=1.0, wall_s=3.0), max_concurrency=2)
    except ValueError as e:
        pytest.skip(f"local sandbox unavailable: {e}")
    yield box
    box.close()


def episode(env, actions, row=ROW):
    """Play FAKE model ``actions``; return the list of step results."""
    env.reset(seed=0, options={"row": row})
    return [env.step(a) for a in actions]


# --- protocol with the real sandbox --------------------------------------------------
def test_registered_env_passes_contract_and_gymnasium_make():
    assert envs.resolve_env_id("code") == "agentgym/Code-v0"
    envs.check_env(envs.make_env("code"))
    env = gymnasium.make("agentgym/Code-v0")
    obs, _ = env.reset(seed=1)
    assert "*user question:*" in obs[0]["content"]
    env.close()


def test_scripted_episode_code_then_correct_answer(sandbox):
    env = CodeEnv(sandbox=sandbox)
    code = "Let me count.\n<code>\n```python\nx = 3 * 12 - 5\nprint(x)\n```\n</code>"
    (obs, r1, te1, tr1, _), (obs2, r2, te2, tr2, info) = episode(
        env, [code, "So there are 31.\n<answer>\n\\boxed{31}\n</answer>"])
    assert obs == [{"role": "tool", "content": "\n<interpreter>\n31\n</interpreter>\n\n"}]
    assert (r1, te1, tr1) == (0.0, False, False)
    assert (obs2, r2, te2, tr2) == ([], 1.0, True, False)
    assert info["em"] == 1.0 and info["answer"] == "31"
    assert (info["tool_calls"], info["tool_failures"], info["malformed_actions"]) == (1, 0, 0)
    env.close()
    sandbox.run_sync("print(1)")  # the env did not close the shared sandbox


def test_wrong_answer_scores_zero_and_equivalent_form_scores_one():
    env = CodeEnv()
    assert episode(env, ["\\boxed{30}"])[-1][1:3] == (0.0, True)
    assert episode(env, ["<answer>\\boxed{31.0}</answer>"])[-1][1:3] == (1.0, True)
    env.close()


def test_malformed_and_empty_code_are_counted_with_corrective_observations():
    env = CodeEnv(max_turns=3)
    (o1, *_), (o2, *_), (o3, _, te, tr, info) = episode(
        env, ["I think it is 31.", "<code>\n```python\n```\n</code>", "<answer>31</answer>"])
    assert o1 == [{"role": "tool", "content": INVALID_ACTION}]
    assert NO_CODE in o2[0]["content"] and "<interpreter>" in o2[0]["content"]
    assert o3 == [] and tr and not te  # an answer without \boxed is not an answer
    assert info["malformed_actions"] == 3 and info["tool_calls"] == 0
    env.close()


def test_code_that_raises_shows_stderr(sandbox):
    env = CodeEnv(sandbox=sandbox)
    [(obs, _, _, _, info)] = episode(env, ["<code>\nprint('before')\n1 / 0\n</code>"])
    text = obs[0]["content"]
    assert text.startswith("\n<interpreter>\nbefore\nTraceback")
    assert "ZeroDivisionError" in text and text.endswith("</interpreter>\n\n")
    assert info["code_errors"] == 1 and info["tool_failures"] == 0


def test_infinite_loop_times_out_as_a_tool_failure(sandbox):
    env = CodeEnv(sandbox=sandbox)
    [(obs, _, te, tr, info)] = episode(env, ["<code>\nwhile True:\n    pass\n</code>"])
    assert "Timeout: execution stopped" in obs[0]["content"]
    assert not te and not tr and info["tool_failures"] == 1 and info["tool_calls"] == 1


def test_output_is_truncated_to_obs_bytes(sandbox):
    env = CodeEnv(sandbox=sandbox, obs_bytes=200)
    [(obs, *_)] = episode(env, ["<code>print('é' * 3000 + 'END')</code>"])
    body = obs[0]["content"].removeprefix("\n<interpreter>\n").removesuffix(
        "\n</interpreter>\n\n")
    assert len(body.encode("utf-8")) <= 200
    assert "bytes truncated ...]" in body and body.startswith("é") and body.endswith("END")


def test_truncate_utf8_never_splits_a_character():
    text = "a" + "🙂" * 100
    for limit in range(64, 120):
        out = truncate_utf8(text, limit)
        assert len(out.encode("utf-8")) <= limit and "\ufffd" not in out
    assert truncate_utf8("short", 64) == "short"


def test_stateful_sessions_persist_within_an_episode_only(sandbox):
    env = CodeEnv(sandbox=sandbox, stateful=True, max_turns=3)
    (o1, *_), (o2, *_) = episode(env, ["<code>y = 41</code>", "<code>print(y + 1)</code>"])
    assert o2[0]["content"] == "\n<interpreter>\n42\n</interpreter>\n\n"
    [(o3, *_)] = episode(env, ["<code>print(y)</code>"])  # a new episode: a new session
    assert "NameError" in o3[0]["content"]
    env.close()


def test_stateless_by_default(sandbox):
    env = CodeEnv(sandbox=sandbox, max_turns=3)
    _, (o2, *_) = episode(env, ["<code>y = 41</code>", "<code>print(y)</code>"])
    assert "NameError" in o2[0]["content"]


def test_code_on_the_last_turn_is_not_run():
    env = CodeEnv(sandbox=RecordingSandbox(), max_turns=1)
    [(obs, reward, te, tr, info)] = episode(env, ["<code>print(1)</code>"])
    assert (obs, reward, te, tr) == ([], 0.0, False, True) and info["tool_calls"] == 1
    assert env._sandbox.calls == []


# --- fakes: session bookkeeping and injected sandbox faults --------------------------
class RecordingSandbox(Sandbox):
    """A FAKE sandbox: echoes the code, records executions and closed sessions."""

    backend = "fake"

    def __init__(self) -> None:
        super().__init__(Limits(), max_concurrency=1)
        self.calls: list[tuple[str, str | None]] = []
        self.closed_sessions: list[str] = []

    async def _execute(self, code, session):
        self.calls.append((code, session))
        return ExecResult(code + "\n", "", 0, False, False, False, 0.0, self.backend)

    async def _close_session(self, session):
        self.closed_sessions.append(session)

    async def _shutdown(self):
        pass


class CrashingSandbox(RecordingSandbox):
    """_execute raises: the Sandbox base turns it into an ``error`` result."""

    async def _execute(self, code, session):
        raise ConnectionResetError("worker died")


class RaisingSandbox(RecordingSandbox):
    """run_sync itself raises (e.g. the sandbox was closed under the env)."""

    def run_sync(self, code, session=None):
        raise RuntimeError("sandbox is closed")


def test_session_ids_are_unique_and_closed_at_episode_end_and_close():
    box = RecordingSandbox()
    a, b = CodeEnv(sandbox=box, stateful=True), CodeEnv(sandbox=box, stateful=True)
    episode(a, ["<code>1</code>", "\\boxed{31}"])
    episode(a, ["<code>2</code>"])  # left open ...
    episode(b, ["<code>3</code>"])
    sessions = [s for _, s in box.calls]
    assert len(set(sessions)) == 3 and None not in sessions
    assert box.closed_sessions == sessions[:1]  # the answered episode closed its session
    a.reset(seed=0, options={"row": ROW})  # ... until the next reset
    b.close()
    b.close()  # idempotent
    assert box.closed_sessions == sessions
    a.close()
    box.run_sync("print(1)")  # a shared sandbox stays open
    box.close()


@pytest.mark.parametrize("box, expected", [(CrashingSandbox, "Sandbox error: ConnectionResetError"),
                                           (RaisingSandbox, "Sandbox error (RuntimeError)")])
def test_broken_sandbox_is_an_observation_not_an_exception(box, expected):
    sandbox = box()
    env = CodeEnv(sandbox=sandbox)
    [(obs, reward, te, tr, info)] = episode(env, ["<code>print(1)</code>"])
    assert expected in obs[0]["content"] and obs[0]["content"].startswith("\n<interpreter>")
    assert (reward, te, tr) == (0.0, False, False)
    assert info["tool_failures"] == 1 and info["tool_calls"] == 1
    env.close()
    sandbox.close()


@pytest.mark.parametrize("text, expected", [
    ("<code>\n```python\nprint(1)\n```\n</code>", ("code", "print(1)")),
    ("<code>\n```py\nprint(1)\n</code>", ("code", "print(1)")),  # unclosed fence
    ("<code>print(2)</code>", ("code", "print(2)")),
    ("<code>print('\\\\boxed{9}')</code>", ("code", "print('\\\\boxed{9}')")),  # box in code
    ("Thus <answer>\n\\boxed{\\frac{1}{2}}\n</answer>", ("answer", "\\frac{1}{2}")),
    ("\\boxed{5} <code>print(1)</code>", ("answer", "5")),  # an answer outside code wins
    ("I will write \\boxed{} later <code>x</code>", ("code", "x")),  # an empty box is not
    ("<code>print(1)", (None, "")),  # cut before </code>
    ("nothing", (None, "")),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


# --- shipped data --------------------------------------------------------------------
@pytest.mark.parametrize("name, n, source", [("train", 7473, "gsm8k"), ("gsm8k", 1319, "gsm8k"),
                                              ("math500", 500, "math500"),
                                              ("aime24", 30, "aime24")])
def test_dataset_rows_load_and_golds_round_trip(name, n, source):
    rows = load_rows("code", name)
    assert len(rows) == n and load_rows("code", name, limit=3) == rows[:3]
    for row in rows[:50] if name == "train" else rows:
        gold = row["reward_model"]["ground_truth"]
        assert row["data_source"] == source and row["ability"] == "math"
        assert row["prompt"] == code_row(row["extra_info"]["question"], gold)["prompt"]
        assert is_equivalent(gold, gold)
        assert _symbolic(gold, gold), gold  # math-verify itself reads every gold answer
    if source == "gsm8k":
        solution = rows[0]["extra_info"]["solution"]
        assert "<<" in solution and solution.split("####")[-1].strip() == \
            rows[0]["reward_model"]["ground_truth"]


def test_gsm8k_test_questions_are_not_in_train():
    def key(r):
        return " ".join(r["extra_info"]["question"].lower().split())
    train = {key(r) for r in load_rows("code", "train")}
    assert len(train) == 7473
    for name in ("gsm8k", "math500", "aime24"):
        assert not train & {key(r) for r in load_rows("code", name)}


def test_shipped_files_stay_small():
    assert sum(p.stat().st_size for p in (ROOT / "data" / "math").iterdir()) < 8e6


@pytest.mark.skipif(not (SHARED / "math").is_dir(), reason="../shared/data not available")
def test_rebuild_is_byte_identical(tmp_path):
    spec = importlib.util.spec_from_file_location("build_math_data",
                                                  ROOT / "scripts" / "build_math_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(SHARED), "--out", str(tmp_path)])
    for f in (ROOT / "data" / "math").iterdir():
        assert (tmp_path / "math" / f.name).read_bytes() == f.read_bytes(), f.name


# --- CLI -----------------------------------------------------------------------------
def test_cli_rollout_with_the_code_env(tmp_path, capsys, sandbox):
    from agentgym.cli import main
    out = tmp_path / "traj.jsonl"
    rc = main(["rollout", "env=code", "model=tiny", "n=2", "limit=2", f"out={out}",
               "rollout.max_tokens_per_turn=32"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    golds = {r["extra_info"]["id"]: [r["reward_model"]["ground_truth"]]
             for r in load_rows("code", "train", limit=2)}
    assert sorted(r["uid"] for r in rows) == sorted(list(golds) * 2)
    for r in rows:
        assert len(r["token_ids"]) == len(r["loss_mask"]) == len(r["logprobs"])
        assert r["terminated"] or r["truncated"]
        assert r["info"]["ground_truth"] == golds[r["uid"]]
    assert "traj/s" in capsys.readouterr().out


def test_env_factory_shares_one_sandbox_built_from_the_config(sandbox):
    from agentgym.config import build_config
    from agentgym.rollout.runtime import env_factory
    cfg = build_config({"env": "code", "code.obs_bytes": 300, "sandbox.stateful": True,
                        "sandbox.max_concurrency": 2})
    assert cfg.rollout.max_turns == 4 and cfg.trainer.eval_data == "gsm8k"  # the preset
    a, b = env_factory(cfg)(), env_factory(cfg)()
    assert a._sandbox is b._sandbox and a._sandbox.max_concurrency == 2
    assert (a.obs_bytes, a.stateful, a.max_turns) == (300, True, 4)
    a.close()
    b.close()
    assert a._sandbox.run_sync("print(6 * 7)").stdout == "42\n"  # not closed by the envs


def test_run_reward_pays_the_first_cell_that_runs_without_error(sandbox):
    """``code.run_reward``: off by default; on, the first cell of an episode that runs
    cleanly earns it on its turn, once; a cell that raises earns nothing."""
    good, bad = "<code>\nprint(3 * 12 - 5)\n</code>", "<code>\n1 / 0\n</code>"
    answer = "<answer>\n\\boxed{31}\n</answer>"
    assert [r for _, r, *_ in episode(CodeEnv(sandbox=sandbox), [good, answer])] == [0.0, 1.0]
    env = CodeEnv(sandbox=sandbox, run_reward=0.2)
    assert [r for _, r, *_ in episode(env, [bad, good, good, answer])] == [0.0, 0.2, 0.0, 1.0]
    assert [r for _, r, *_ in episode(env, [good])] == [0.2]  # a new episode pays again
    env = CodeEnv(sandbox=sandbox, run_reward=0.2, protocol="tools")
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(31)"}}\n</tool_call>'
    assert [r for _, r, *_ in episode(env, [call, call])] == [0.2, 0.0]
    with pytest.raises(ValueError, match="run_reward"):
        CodeEnv(sandbox=sandbox, run_reward=-1)
