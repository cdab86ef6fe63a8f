"""env=swe: SWE-bench rows over a user's repository, the workspace's isolation and cleanup,
both tool protocols, and SWE-bench's grading (each test one property, on real processes
under real isolation)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from agentgym.cli import main as cli
from agentgym.data.rows import load_rows, write_jsonl
from agentgym.envs import make_env
from agentgym.envs.swe import SUBMIT
from agentgym.envs.swe_grade import repo_cache, workspace_root
from agentgym.envs.swe_rows import adapt_row, without_test_edits
from agentgym.tools.sandbox_local import UID_BASE, UID_SPAN
from agentgym.tools.workspace import CommandLimits, Workspace, clean_stale

# -- a repository the project does not ship: a local git folder with its tests ---------------
SRC = '"""Text helpers."""\n\n\ndef shout(text):\n    return text.upper() + "!"\n\n\n' \
      'def count_words(text):\n    return len(text.split(" "))\n'
FIXED = SRC.replace('len(text.split(" "))', "len(text.split())")
TESTS = 'from wordy import shout\n\n\ndef test_shout():\n    assert shout("hi") == "HI!"\n'
HIDDEN = TESTS.replace("import shout", "import count_words, shout") + \
    '\n\ndef test_count_spaces():\n    assert count_words("a  b ") == 2\n'


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory):
    """A git folder with history after its base commit (the fix, then the fix's test), and
    the row of SWE-bench's schema that points at it."""
    repo = tmp_path_factory.mktemp("user") / "wordy"
    repo.mkdir()
    _git(repo, "init", "-q")
    base = _commit(repo, {"wordy/__init__.py": "from wordy.text import count_words, shout\n",
                          "wordy/text.py": SRC, "tests/test_text.py": TESTS}, "base")
    fix = _commit(repo, {"wordy/text.py": FIXED}, "the fix")
    patch = _git(repo, "diff", base, fix)
    test = _commit(repo, {"tests/test_text.py": HIDDEN}, "the fix's test")
    test_patch = _git(repo, "diff", fix, test)
    row = {"instance_id": "me__wordy-1", "repo": "me/wordy", "base_commit": base,
           "problem_statement": 'count_words("a  b ") returns 4; it should count 2 words.',
           "patch": patch, "test_patch": test_patch, "version": "1.0",
           # as SWE-bench's Hugging Face copies carry them: JSON strings
           "FAIL_TO_PASS": json.dumps(["tests/test_text.py::test_count_spaces"]),
           "PASS_TO_PASS": json.dumps(["tests/test_text.py::test_shout"]),
           "environment_setup_commit": base}
    return repo, row


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0" + oct(path.lstat().st_mode).encode())
        if path.is_file() and not path.is_symlink():
            h.update(path.read_bytes())
    return h.hexdigest()


def _sandbox_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "uid=,pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if UID_BASE <= int(line.split()[0]) < UID_BASE + UID_SPAN]


def _overlay_mounts() -> list[str]:
    return [m for m in Path("/proc/mounts").read_text().splitlines()
            if str(workspace_root()) in m]


def test_a_users_swe_bench_rows_load_unchanged_and_validate(user_repo, tmp_path, capsys):
    repo, row = user_repo
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, [{**row, "repo_path": str(repo)}])
    rows = load_rows("swe", str(data))
    assert rows[0]["FAIL_TO_PASS"] == ["tests/test_text.py::test_count_spaces"]
    assert rows[0]["reward_model"]["ground_truth"]["PASS_TO_PASS"] == ["tests/test_text.py::test_shout"]
    assert cli(["swe", "validate", f"data={data}"]) == 0
    out = capsys.readouterr().out
    assert "ok   me__wordy-1: gold resolved (F2P 1.00, P2P 1.00); empty diff not resolved " \
           "(F2P 0.00, P2P 1.00)" in out, out
    assert "1 of 1 rows valid" in out


def test_validate_finds_the_repository_in_swe_repos_and_fails_a_wrong_gold_patch(
        user_repo, tmp_path, capsys):
    repo, row = user_repo
    repos = tmp_path / "repos"
    repos.mkdir()
    subprocess.run(["git", "bundle", "create", str(repos / "me__wordy.bundle"), "--all"],
                   cwd=repo, check=True, capture_output=True)
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, [row, {**row, "instance_id": "me__wordy-wrong", "patch": ""}])
    assert cli(["swe", "validate", f"data={data}", f"swe.repos={repos}"]) == 1
    out = capsys.readouterr().out
    assert "ok   me__wordy-1:" in out
    assert "FAIL me__wordy-wrong: gold not resolved (F2P 0.00, P2P 1.00)" in out
    assert "1 of 2 rows valid" in out


def test_rows_that_cannot_run_here_are_refused_by_name(user_repo, tmp_path):
    _, row = user_repo
    with pytest.raises(ValueError, match=r"me__wordy-1.*Docker image 'swebench/x:latest'.*repo_path"):
        adapt_row({**row, "image_name": "swebench/x:latest"}, "rows.jsonl:1")
    with pytest.raises(ValueError, match=r"lacks \['test_patch'\]"):
        adapt_row({k: v for k, v in row.items() if k != "test_patch"}, "rows.jsonl:1")
    env = make_env("swe")
    with pytest.raises(FileNotFoundError, match=r"no local copy of 'me/wordy'.*swe.repos"):
        env.reset(options={"row": row})
    env.close()


def test_the_agents_copy_has_no_history_and_the_base_survives_edits(user_repo):
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    before = _tree_digest(base)
    with Workspace(base, workspace_root()) as ws:
        log = ws.run("git log --all --format=%s").output
        assert log.strip() == f"base {row['base_commit'][:12]}", log  # not "the fix"
        r = ws.run("echo '# edited' >> wordy/text.py && echo new > new.txt && "
                   "rm tests/test_text.py && mkdir -p d/e && echo x > d/e/f && git status --short")
        assert r.exit_code == 0 and " M wordy/text.py" in r.output and " D tests/test_text.py" in r.output
        again = ws.run("cat new.txt; ls tests | wc -l").output.split()
        assert again == ["new", "0"]  # kept from command to command
        diff = ws.diff()
        assert "+# edited" in diff and "new.txt" in diff and "deleted file" in diff
        assert _overlay_mounts() == []  # the overlay lives in the command's namespace only
        folder = ws.dir
    assert not folder.exists()
    assert _tree_digest(base) == before


def test_commands_have_no_network_no_host_and_leave_no_process(user_repo):
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    with Workspace(base, workspace_root(), CommandLimits(wall_s=5)) as ws:
        net = ws.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 80), 3)\"")
        assert net.exit_code == 1 and "Network is unreachable" in net.output
        assert "Read-only file system" in ws.run("touch /usr/x").output
        project = Path(__file__).resolve().parents[1] / "agentgym" / "cli.py"
        seen = ws.run(f"ls /etc/passwd {project} {Path.home()}/.bash_history 2>&1; true").output
        assert seen.count("No such file or directory") == 3, seen
        assert ws.run("(sleep 300 &) ; setsid sleep 300 & echo started").output.strip() == "started"
        slow = ws.run("sleep 300", wall_s=1)
        assert slow.timed_out and slow.exit_code is None
        bomb = ("import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
                "            os.close(1); time.sleep(60); os._exit(0)\n        n += 1\n"
                "except OSError as e:\n    print('refused after', n, e.strerror)\n")
        forks = ws.run(f"python -c {shlex.quote(bomb)}")
        assert "Resource temporarily unavailable" in forks.output, forks  # RLIMIT_NPROC
        assert int(forks.output.split()[2]) < CommandLimits().max_procs
    # a namespace's processes are SIGKILLed as it ends, and reaped after the command returns
    wait_until(lambda: _sandbox_processes() == [], 60, "the sandboxes' processes ending")


def test_a_command_past_the_disk_quota_is_stopped(user_repo):
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    with Workspace(base, workspace_root(), CommandLimits(disk_mb=4, file_size_mb=2)) as ws:
        one = ws.run("head -c 8000000 /dev/zero > big.bin; ls -l big.bin")
        assert "File size limit exceeded" in one.output and " 2097152 " in one.output  # RLIMIT_FSIZE
        assert not one.quota_exceeded
        many = ws.run("for i in $(seq 100); do head -c 1000000 /dev/urandom > f$i; done; echo end")
        assert many.quota_exceeded


def test_multiprocessings_locks_work_in_a_shared_memory_of_the_sandboxs_own(user_repo):
    """A repository's tests may use multiprocessing (toolz's do): its semaphores need a
    writable /dev/shm, which the host's (root's) is not. The sandbox mounts one of its own,
    bounded at SHM_MB, and it is gone with the command."""
    from agentgym.tools.sandbox_local import SHM_MB
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    lock = "python -c 'import multiprocessing as m; l = m.Lock(); l.acquire(); print(\"locked\")'"
    with Workspace(base, workspace_root(), CommandLimits(file_size_mb=512)) as ws:
        assert ws.run(lock).output.strip() == "locked"
        fill = ws.run("head -c 200000000 /dev/zero > /dev/shm/x; du -m /dev/shm/x | cut -f1")
        assert "No space left on device" in fill.output
        assert int(fill.output.split()[-1]) <= SHM_MB
        assert ws.run("ls /dev/shm | wc -l").output.strip() == "0"


def test_long_output_keeps_head_and_tail_and_counts_the_cut(user_repo):
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    with Workspace(base, workspace_root(), CommandLimits(keep_output_bytes=1000)) as ws:
        r = ws.run("echo START; seq 1 100000; echo END")
    assert r.output.startswith("START\n1\n") and r.output.rstrip().endswith("100000\nEND")
    assert f"[... {r.cut_bytes} bytes cut ...]" in r.output and r.cut_bytes > 500_000


def test_stale_workspaces_of_a_dead_process_are_removed(tmp_path):
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    (tmp_path / f"{dead}-0" / "upper").mkdir(parents=True)
    (tmp_path / f"{os.getpid()}-0").mkdir()
    assert clean_stale(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}-0"]


def test_bash_protocol_solves_submits_and_is_graded(user_repo):
    repo, row = user_repo
    env = make_env("swe", max_turns=5)
    obs, _ = env.reset(options={"row": {**row, "repo_path": str(repo)}})
    assert "count_words" in obs[-1]["content"] and "mswea_bash_command" in obs[0]["content"]
    obs, *_ = env.step("THOUGHT: two blocks\n```bash\nls\n```\n```bash\nls\n```")
    assert "contained 2" in obs[0]["content"]
    obs, *_ = env.step("```mswea_bash_command\ncat wordy/text.py\n```")
    assert obs[0]["content"].startswith("<returncode>0</returncode>") and "def shout" in obs[0]["content"]
    env.step("```bash\nsed -i 's/split(\" \")/split()/' wordy/text.py\n```")
    obs, reward, terminated, truncated, info = env.step(f"```bash\necho {SUBMIT}\n```")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["resolved"] == info["f2p"] == info["p2p"] == info["applied"] == info["submitted"] == 1.0
    assert info["malformed_actions"] == 1 and info["diff_lines"] == 2 and "infra_error" not in info
    env.close()


def test_edits_to_the_tests_are_dropped_before_grading(user_repo):
    repo, row = user_repo
    env = make_env("swe", max_turns=1)
    env.reset(options={"row": {**row, "repo_path": str(repo)}})
    cheat = ("mkdir -p tests && printf 'def test_count_spaces():\\n    pass\\n' > tests/test_text.py"
             " && printf 'collect_ignore = []\\n' > conftest.py")
    obs, reward, terminated, truncated, info = env.step(f"```bash\n{cheat}\n```")
    assert (reward, terminated, truncated) == (0.0, False, True)  # graded at the turn limit
    assert info["f2p"] == 0.0 and sorted(info["test_edits_dropped"]) == ["conftest.py",
                                                                         "tests/test_text.py"]
    env.close()


def test_tools_protocol_edits_with_str_replace_editor(user_repo):
    repo, row = user_repo
    env = make_env("swe", max_turns=9, protocol="tools")
    env.reset(options={"row": {**row, "repo_path": str(repo)}})
    names = [t["function"]["name"] for t in env.tools]
    assert names == ["bash", "str_replace_editor", "submit"]

    def call(name, **arguments):
        obs, reward, terminated, truncated, info = env.step(
            f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>')
        return (obs[0]["content"] if obs else ""), reward, info

    text, *_ = call("str_replace_editor", command="view", path="/testbed/wordy/text.py")
    assert "     9\t    return len(text.split(\" \"))" in text
    text, *_ = call("str_replace_editor", command="str_replace", path="/testbed/wordy/text.py",
                    old_str="return", new_str="return")
    assert "Multiple occurrences" in text
    text, *_ = call("str_replace_editor", command="str_replace", path="/testbed/wordy/text.py",
                    old_str='split(" ")', new_str="split(None)")
    assert "has been edited" in text and "split(None)" in text
    text, *_ = call("str_replace_editor", command="undo_edit", path="/testbed/wordy/text.py")
    assert 'split(" ")' in text
    text, *_ = call("str_replace_editor", command="insert", path="/testbed/wordy/text.py",
                    insert_line=0, new_str="# fixed")
    assert "     1\t# fixed" in text
    text, *_ = call("str_replace_editor", command="create", path="wordy/x.py", file_text="")
    assert "not an absolute path" in text and "/testbed/wordy/x.py" in text
    text, *_ = call("bash", command="sed -i 's/split(\" \")/split()/' wordy/text.py && echo ok")
    assert "ok" in text
    bad = env.step('<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>')
    assert "missing required argument" in bad[0][0]["content"]
    _, reward, info = call("submit")
    assert reward == 1.0 and info["resolved"] == 1.0 and info["malformed_actions"] == 1
    env.close()


def test_without_test_edits_keeps_the_source_and_names_what_it_drops():
    patch = ("diff --git a/pkg/a.py b/pkg/a.py\n--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1 +1 @@\n-x\n+y\n"
             "diff --git a/tests/test_a.py b/tests/test_a.py\n--- a/tests/test_a.py\n+++ b/tests/"
             "test_a.py\n@@ -1 +1 @@\n-x\n+y\n"
             "diff --git a/pkg/check.py b/pkg/check.py\n--- a/pkg/check.py\n+++ b/pkg/check.py\n")
    test_patch = "diff --git a/pkg/check.py b/pkg/check.py\n--- a/pkg/check.py\n+++ b/pkg/check.py\n"
    kept, dropped = without_test_edits(patch, test_patch)
    assert kept.startswith("diff --git a/pkg/a.py") and "tests/" not in kept and "check" not in kept
    assert dropped == ["tests/test_a.py", "pkg/check.py"]


def test_check_env_reports_ok_for_swe(capsys):
    assert cli(["check-env", "swe"]) == 0
    assert capsys.readouterr().out.strip() == "ok    agentgym/SWE-v0"


IN_FLIGHT = 32
_CHILD = r'''
import sys, threading
from pathlib import Path
from agentgym.envs import make_env
from agentgym.envs.swe_grade import workspace_root
row = __import__("json").loads(sys.argv[1])
envs = [make_env("swe", max_turns=4) for _ in range(int(sys.argv[2]))]
for env in envs:
    env.reset(options={"row": row})
# each episode mid-command: a daemon of its own, and a command that does not end
step = lambda env: env.step("```bash\n(setsid sleep 600 &); touch started; sleep 600\n```")
for env in envs:
    threading.Thread(target=step, args=(env,), daemon=True).start()
while sum((env._ws.upper / "started").exists() for env in envs) < len(envs):
    threading.Event().wait(0.05)
print("ready", flush=True)
threading.Event().wait()
'''


def test_episodes_in_flight_leave_nothing_behind_even_when_the_trainer_is_killed(
        user_repo, tmp_path):
    """32 episodes mid-command, then SIGKILL to their process: no process of the sandbox's
    uids is left, nothing is mounted, and the next process to start empties the root."""
    repo, row = user_repo
    root = workspace_root()
    child = subprocess.Popen([sys.executable, "-c", _CHILD,
                              json.dumps({**row, "repo_path": str(repo)}), str(IN_FLIGHT)],
                             stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert child.stdout.readline().strip() == "ready"
        live = _sandbox_processes()
        assert len(live) >= 2 * IN_FLIGHT, live  # each episode's command and its daemon
        mine = [p for p in root.iterdir() if p.name.startswith(f"{child.pid}-")]
        assert len(mine) == IN_FLIGHT
    finally:
        child.kill()
        child.wait()
    wait_until(lambda: _sandbox_processes() == [], 60, "the sandboxes' processes ending")
    assert _overlay_mounts() == []
    assert all(p.exists() for p in mine)  # until the next start
    subprocess.run([sys.executable, "-c", "from agentgym.envs.swe_grade import workspace_root; "
                    "workspace_root()"], check=True, env=os.environ)
    assert not any(p.exists() for p in mine)


def test_episodes_in_flight_that_end_normally_leave_nothing_behind(user_repo):
    import concurrent.futures
    repo, row = user_repo
    root = workspace_root()
    before = set(root.iterdir())

    def episode(i):
        env = make_env("swe", max_turns=3)
        env.reset(seed=i, options={"row": {**row, "repo_path": str(repo)}})
        env.step("```bash\n(setsid sleep 600 &); echo $i > mine.txt; cat wordy/text.py | wc -l\n```")
        env.close()
        env.close()  # idempotent

    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        list(pool.map(episode, range(IN_FLIGHT)))
    assert set(root.iterdir()) == before
    # a namespace's processes are SIGKILLed as it ends, and reaped after the command returns
    wait_until(lambda: _sandbox_processes() == [], 60, "the sandboxes' processes ending")


def test_mini_swe_agent_unmodified_trains_two_steps(tmp_path):
    """mini-swe-agent's own loop plays the built-in tasks against the run's endpoint, its
    commands run in the episodes' workspaces, the harness rewards them, and the trainer
    updates on the recorded tokens (a scripted model's replies, one fix a group)."""
    from agentgym.rollout.engines.base import ENGINES
    if "scripted-swe-model" not in ENGINES.names():
        ENGINES.register("scripted-swe-model", "fakes:ScriptedSWEModel")
    run = tmp_path / "run"
    assert cli(["train", "env=mini-swe-agent", "model=tiny", "trainer.total_steps=2",
                "trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_turns=4",
                "rollout.max_tokens_per_turn=256", "engine=scripted-swe-model",
                f"run_dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "rollout/reward" in s]
    assert len(steps) == 2
    for step in steps:
        assert step["agent/failed"] == 0.0
        assert step["rollout/reward"] == 0.5  # one sample of each task fixed it
        assert step["rollout/adv_abs"] > 0 and step["train/grad_norm"] > 0  # it updated
    wait_until(lambda: _sandbox_processes() == [], 60, "the episodes' daemons ending")


def test_the_repository_gets_an_environment_of_its_own(user_repo):
    """By default a repository's commands get a venv made once with pytest's distributions
    alone (no plugin or package of the project's environment); swe.python names another."""
    from agentgym.envs.swe_grade import repo_python
    repo, row = user_repo
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    own = repo_python(row, "", ["pytest"])
    assert own == repo_python(row, "", ["pytest"]) and own != sys.executable  # made once
    probe = "python -c 'import pytest, pluggy; import numpy' 2>&1 | tail -1; python -m pytest --co -q tests | tail -1"
    with Workspace(base, workspace_root(), python=own) as ws:
        out = ws.run(probe).output
    assert "No module named 'numpy'" in out and "1 test collected" in out, out
    with Workspace(base, workspace_root(), python=repo_python(row, sys.executable, [])) as ws:
        assert ws.run("python -c 'import numpy; print(numpy.__name__)'").output.strip() == "numpy"
    with pytest.raises(ValueError, match="needs 'no-such-dist'.*swe.python"):
        repo_python(row, "", ["pytest", "no-such-dist"])


HOSTILE = '''import os, socket, subprocess, time


def test_the_network_is_refused():
    try:
        socket.create_connection(("1.1.1.1", 80), 3)
    except OSError:
        return
    raise AssertionError("connected")


def test_writes_outside_the_workspace_are_refused():
    for path in ("/etc/agentgym-escape", "/usr/agentgym-escape", "HOST_FILE"):
        try:
            open(path, "w").write("x")
        except OSError:
            continue
        raise AssertionError(f"wrote {path}")


def test_forking_without_limit_is_refused():
    kids = []
    try:
        for _ in range(1000):
            pid = os.fork()
            if pid == 0:
                os.close(1)
                time.sleep(60)
                os._exit(0)
            kids.append(pid)
    except OSError:
        refused = True
    else:
        refused = False
    for pid in kids:  # the limit is the uid's: the next test needs its processes back
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert refused, f"forked {len(kids)}"


def test_a_daemon_is_left_behind():
    subprocess.Popen(["sleep", "600"], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
'''


def test_a_repositorys_hostile_tests_are_refused_or_cleaned_up(user_repo, tmp_path):
    """The harness runs a row's tests under the sandbox: tests that try the network, write
    outside the workspace (the host's /etc, /usr, a path beside the test), fork without
    limit and leave a daemon behind are each refused or cleaned up, and grade as usual."""
    from agentgym.envs.swe_grade import grade, repo_python
    repo, row = user_repo
    host_file = tmp_path / "escaped"
    hostile = HOSTILE.replace("HOST_FILE", str(host_file))
    lines = hostile.splitlines()
    test_patch = ("diff --git a/tests/test_hostile.py b/tests/test_hostile.py\nnew file mode "
                  "100644\n--- /dev/null\n+++ b/tests/test_hostile.py\n"
                  f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines))
    hidden = _git(repo, "diff", row["base_commit"], "HEAD", "--", "tests/test_text.py")
    names = ["test_the_network_is_refused", "test_writes_outside_the_workspace_are_refused",
             "test_forking_without_limit_is_refused", "test_a_daemon_is_left_behind"]
    hostile_row = {**adapt_row(row, "test"), "test_patch": hidden + test_patch,
                   "PASS_TO_PASS": [*json.loads(row["PASS_TO_PASS"]),
                                    *(f"tests/test_hostile.py::{n}" for n in names)]}
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    g = grade(hostile_row, base, row["patch"], workspace_root(), CommandLimits(wall_s=120),
              120, repo_python(row, "", ["pytest"]))
    assert g.infra == "" and g.resolved, (g.statuses, g.log[-2000:])
    assert all(g.statuses[f"tests/test_hostile.py::{n}"] == "PASSED" for n in names)
    assert not host_file.exists() and not Path("/etc/agentgym-escape").exists()
    wait_until(lambda: _sandbox_processes() == [], 60, "the tests' daemon ending")


def test_mutations_are_one_span_each_and_leave_valid_python():
    from agentgym.envs.swe_mutate import mutations
    src = ('def f(xs, n):\n    """Doc: 1 < 2."""\n    total = 0\n    for x in xs:\n'
           '        if x < n and x != 3:\n            total += max(x, 1)\n    return total\n\n'
           'LIMIT = 5\n')
    found = mutations(src)
    kinds = {m.kind for m in found}
    assert kinds == {"flip_comparison", "off_by_one", "swap_arguments", "drop_statement",
                     "change_operator"}
    for m in found:
        out = m.apply(src)
        changed = [(a, b) for a, b in zip(src.splitlines(), out.splitlines()) if a != b]
        assert out != src and '"""Doc: 1 < 2."""' in out and "LIMIT = 5" in out
        assert m.function == "f"
        if m.kind != "drop_statement":
            assert len(changed) == 1, (m, changed)
    swap = next(m for m in found if m.kind == "swap_arguments")
    assert "max(1, x)" in swap.apply(src)
    drop = next(m for m in found if m.kind == "drop_statement" and "total = 0" not in
                m.apply(src))
    assert drop.apply(src).count("\n") == src.count("\n") - 1


CALC = '''"""Small helpers."""


def clamp(x, lo, hi):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def total(values, start=0):
    result = start
    for v in values:
        result += v
    return result


def first_word(text):
    words = text.split()
    return words[0] if words else ""
'''
CALC_TESTS = '''from calc import clamp, first_word, total


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-3, 0, 10) == 0


def test_clamp_high():
    assert clamp(12, 0, 10) == 10


def test_total():
    assert total([1, 2, 3]) == 6


def test_total_start():
    assert total([1], start=4) == 5


class TestWords:
    def test_first(self):
        assert first_word("hello big world") == "hello"

    def test_empty(self):
        assert first_word("   ") == ""
'''


def test_the_task_maker_keeps_bugs_that_tests_catch_and_hides_those_tests(tmp_path):
    """From a package's sdist (here a local one), make-tasks's steps: each kept bug fails at
    least one test, its failing tests are out of the base and back with test_patch, the
    gold patch resolves and an empty diff does not, and the statement says what fails
    without naming the bug's file, function or line unless the traceback does."""
    import tarfile

    from agentgym.envs import swe_make
    from agentgym.envs.swe_grade import grade, repo_python
    pkg = tmp_path / "calc-1.0"
    pkg.mkdir()
    (pkg / "calc.py").write_text(CALC)
    (pkg / "test_calc.py").write_text(CALC_TESTS)
    sdist = tmp_path / "calc-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(pkg, arcname="calc-1.0")
    source = swe_make.Source("calc", "1.0", "test_calc.py", sdist=str(sdist))
    report = swe_make.make_repo_tasks(source, tmp_path / "work", 4, 0)
    lines = []
    while True:
        try:
            lines.append(next(report))
        except StopIteration as done:
            rows, repo = done.value
            break
    assert lines[0].startswith("calc 1.0: 7 tests pass at baseline (")
    assert len(rows) == 3  # one bug a function: clamp, total, first_word
    python = repo_python(rows[0], "", ["pytest"])
    for row in rows:
        base = repo_cache().base(row["repo"], repo, row["base_commit"])
        hidden = {t.split("::")[-1] for t in row["FAIL_TO_PASS"]}
        assert not any(f"def {name}(" in (base / "test_calc.py").read_text() for name in hidden)
        assert all(f"+    def {n}(" in row["test_patch"] or f"+def {n}(" in row["test_patch"]
                   for n in hidden)
        assert (base / "calc.py").read_text() != CALC  # the bug is in the base
        limits = CommandLimits(wall_s=120, cpu_s=120)
        assert grade(row, base, row["patch"], workspace_root(), limits, 120, python).resolved
        assert not grade(row, base, "", workspace_root(), limits, 120, python).resolved
        said, shown = row["problem_statement"], row["failing_traceback"]
        m = row["mutation"]
        assert "calc.py" not in said.replace("test_calc.py", "") or \
            "calc.py" in shown.replace("test_calc.py", "")
        for name in (m["function"], f"line {m['line']}"):
            assert name not in said or name in shown, (name, said)
        # the traceback as pytest showed it: the test's frame, its code, the error
        assert "It should pass." in said and "\n```\ntest_calc.py:" in said
        assert said == swe_make.restate(row)["problem_statement"]


def test_where_no_overlay_mounts_a_workspace_is_a_copy_and_works_the_same(user_repo):
    from agentgym.tools.workspace import overlay_works
    repo, row = user_repo
    assert overlay_works(workspace_root())  # this machine's disk takes an overlay
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    before = _tree_digest(base)
    with Workspace(base, workspace_root(), CommandLimits(disk_mb=1), overlay=False) as ws:
        assert ws.run("echo '# edited' >> wordy/text.py && rm tests/test_text.py").exit_code == 0
        assert "+# edited" in ws.diff() and "deleted file" in ws.diff()
        assert ws.disk_bytes() < 1 << 20 and not ws.run("true").quota_exceeded
        assert ws.run("head -c 3000000 /dev/urandom > big.bin").quota_exceeded
    assert _tree_digest(base) == before


# -- the cold start's demonstrations -------------------------------------------------------
def test_demonstrations_solve_tasks_with_either_protocol_and_replay(user_repo):
    """A demonstration finds the code, opens it, edits it, runs the tests and submits (five
    turns), with the bash protocol on a user's row and with the tool calls
    on the built-in tasks; each is graded resolved, and replaying its actions is graded
    resolved again."""
    from agentgym.data.demo_builders import build_demos
    from agentgym.data.demos import replay_demo
    from agentgym.envs.swe import SWEEnv
    from agentgym.envs.swe_builtin import builtin_rows
    from agentgym.envs.swe_grade import swe_root
    from agentgym.envs.swe_demos import recovery
    plain = next(f"me__wordy-{i}" for i in range(100)
                 if recovery({"instance_id": f"me__wordy-{i}"}) == "none")
    (demo,) = build_demos("swe", [dict(user_repo[1], repo_path=str(user_repo[0]),
                                       instance_id=plain)], lambda: SWEEnv(max_turns=10))
    assert demo["recovery"] == "none" and "learn" not in demo
    assert len(demo["actions"]) == 5 and demo["reward"] == 1.0
    assert 'grep -rnE "(def|class) count_words\\b" --include=*.py --exclude-dir=test ' \
        '--exclude-dir=tests' in demo["actions"][0]
    # the view starts at the line the listing showed: count_words's def
    assert "./wordy/text.py:8:def count_words(text):" in demo["observations"][0][0]["content"]
    assert "nl -ba wordy/text.py | sed -n '8,10p'" in demo["actions"][1]
    # the thought says what is wrong in the code's own text before the script types it
    assert "This is the bug: in `return len(text.split(\" \"))`, `\" \"` should not be " \
        "there. I replace line 9." in demo["actions"][2]
    assert "<returncode>0</returncode>" in demo["observations"][2][0]["content"]
    assert "passed" in demo["observations"][3][0]["content"]
    assert "The tests pass with my edit of wordy/text.py: I submit." in demo["actions"][-1]
    assert demo["actions"][-1].endswith(f"echo {SUBMIT}\n```")
    rows = builtin_rows(swe_root() / "builtin")
    demos = build_demos("swe", rows, lambda: SWEEnv(protocol="tools", max_turns=10))
    assert len(demos) == len(rows) == 2
    for d in [demo, *demos]:
        env = SWEEnv(protocol="tools" if d is not demo else "bash", max_turns=10)
        try:
            again = replay_demo(d, env)
        finally:
            env.close()
        assert again["reward"] == 1.0 and again["info"]["resolved"] == 1.0
        assert again["info"]["format_valid"] == 1.0
        assert [again["info"][k] for k in ("opened_file", "edited_file", "ran_tests")] == \
            [1.0] * 3
        # the test run names only files an earlier observation showed (none: the suite)
        run = d["actions"][-2]
        shown = d["row"]["problem_statement"] + "".join(
            str(m["content"]) for o in d["observations"][:-1] for m in o)
        named = [w for w in re.findall(r"[\w/.-]+\.py", run.split("pytest", 1)[1])]
        assert all(f in shown for f in named), (named, run)
        f2p = {t.split("::", 1)[0] for t in d["row"]["FAIL_TO_PASS"]}
        assert again["info"]["opened_test"] == float(bool(f2p & set(named)))
    # the listing showed no test file: the suite runs
    assert "pytest -q -p no:cacheprovider 2>&1 | tail -n 3" in demo["actions"][-2]
    calls = [json.loads(a.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0])
             for a in demos[0]["actions"]]
    assert [c["name"] for c in calls][-4:] == ["str_replace_editor", "str_replace_editor",
                                               "bash", "submit"]
    assert [c["arguments"].get("command") for c in calls[-4:-1]] == \
        ["view", "str_replace", calls[-2]["arguments"]["command"]]


def test_the_edits_thought_names_what_changes():
    """:func:`change` keeps what lies between the old and new text's common start and end,
    in whole tokens (``<`` becomes ``<=``, not ``=`` inserted); the thought quotes the line
    around it, or says a line is missing or should go."""
    from agentgym.envs.swe_demos import _bug, change
    assert change("    if a < b:\n", "    if a <= b:\n") == ("<", "<=")
    assert change("    f(x, y)\n", "    f(y, x)\n") == ("x, y", "y, x")
    assert change("    x = 1\n    return x\n", "    x = 1\n    y += 2\n    return x\n") == \
        ("", "y += 2")
    assert _bug("    return n - 1\n", "    return n\n") == \
        "This is the bug: in `return n - 1`, `- 1` should not be there."
    assert _bug("    x = 1\n    y = 2\n", "    x = 1\n") == \
        "This is the bug: `y = 2` should not be there."
    assert _bug("    n = 1\n", "    n = 0\n") == "This is the bug: in `n = 1`, `1` should be `0`."
    assert _bug("a\n", "a\nb\n") == "This is the bug: `b` is missing."


def test_the_demonstrations_search_leaves_out_test_files(user_repo):
    """The search lists source files only (the files ``is_test_path`` names are left out):
    a name only a test file defines comes back empty, as one nothing defines does, and a
    word used in the tests and the source lists the source's lines alone."""
    from agentgym.envs.swe_demos import _search
    repo, _ = user_repo

    def run(command: str) -> str:
        return subprocess.run(["bash", "-c", command], cwd=repo, capture_output=True,
                              text=True, check=True).stdout

    assert run(_search("test_shout", True)) == ""
    assert run(_search("shout", True)) == "./wordy/text.py:4:def shout(text):\n"
    assert run(_search("shout", False)).splitlines() == [
        "./wordy/__init__.py:1:from wordy.text import count_words, shout",
        "./wordy/text.py:4:def shout(text):"]


def test_half_the_demonstrations_recover_from_an_empty_search(user_repo, tiny_tokenizer):
    """Which tasks' demonstrations recover is fixed by the instance id (half): a search for a
    name of the statement that nothing defines, an empty listing, then another name and the
    plain demonstration's steps; the replay is graded resolved. The search is never for a
    builtin the statement uses. A record's ``learn`` keeps an action it marks out of the
    loss, its tokens in the sequence with mask 0."""
    from agentgym.data.demos import demo_to_trajectory, env_protocol, replay_demo
    from agentgym.envs.swe import SWEEnv
    from agentgym.envs.swe_demos import RECOVERIES, recovery, swe_demo
    from agentgym.rollout.chat import ChatTokens
    repo, row = user_repo
    ids = [f"me__wordy-{i}" for i in range(600)]
    kinds = [recovery({"instance_id": i}) for i in ids]
    assert RECOVERIES == ("none", "empty_search")
    assert all(250 < kinds.count(k) < 350 for k in RECOVERIES)
    statement = ("Counting words is wrong:\n```python\nif isinstance(s, str):\n"
                 "    result = count_words(\"a  b \")\n```\nreturns 4; it should count 2 words.")
    env = SWEEnv(max_turns=10)
    demos = {}
    try:
        for kind in RECOVERIES:
            task = dict(row, repo_path=str(repo), problem_statement=statement,
                        instance_id=ids[kinds.index(kind)])
            demos[kind] = d = swe_demo(task, env)
            assert d["recovery"] == kind and "learn" not in d
            again = replay_demo(d, env)
            assert again["reward"] == 1.0 and again["info"]["format_valid"] == 1.0
    finally:
        env.close()
    plain = demos["none"]["actions"]
    assert len(plain) == 5 and "(def|class) count_words\\b" in plain[0]  # not isinstance
    d = demos["empty_search"]
    assert 'grep -rnE "(def|class) result\\b"' in d["actions"][0]
    assert "<output>\n</output>" in d["observations"][0][0]["content"]
    assert "Nothing defines result; I look for count_words" in d["actions"][1]
    assert d["actions"][1].split("\n```")[1] == plain[0].split("\n```")[1]
    assert d["actions"][2:] == plain[1:]
    # a step marked out of the loss: played (in the context, mask 0), the rest learned
    chat = ChatTokens(tiny_tokenizer)
    traj = demo_to_trajectory(dict(d, learn=[False] + [True] * 5), chat, *env_protocol("swe"))
    played = [s for s in traj.segments if s.kind == "played"]
    assert [s.turn for s in played] == [0]
    assert all(traj.loss_mask[i] == 0 for s in played for i in range(s.start, s.end))
    learned = [s for s in traj.segments if s.kind == "generated"]
    assert [s.turn for s in learned] == [1, 2, 3, 4, 5]
    assert traj.num_sampled == sum(len(s) for s in learned)
    with pytest.raises(ValueError, match="'learn' must be one true or false per action"):
        demo_to_trajectory(dict(d, learn=[True]), chat, "chat", ())


def test_a_traceback_through_the_source_leads_the_demonstration_to_its_line(user_repo):
    """Where the statement's traceback goes through a source file (its last frame outside
    the tests), the demonstration opens that file there first, typing the traceback's path
    and number as they are: where it is the patched file near the edit, the edit follows
    (no search: view, edit, tests, submit); where it is another file, the search follows;
    where the traceback names only tests, the search comes first."""
    from agentgym.data.demos import replay_demo
    from agentgym.envs.swe import SWEEnv
    from agentgym.envs.swe_demos import RECOVERIES, frame, recovery, swe_demo, view_at
    from agentgym.envs.swe_make import report
    repo, row = user_repo
    test = "tests/test_text.py:5: in test_count_spaces\n    assert count_words(\"a  b \") == 2\n"
    through = report("wordy", "1.0", test + "wordy/text.py:9: in count_words\n"
                     "    return len(text.split(\" \"))\nE   AssertionError", 0)
    elsewhere = report("wordy", "1.0", test + "wordy/__init__.py:1: in <module>\n"
                       "    from wordy.text import count_words, shout\nE   AssertionError", 0)
    tests_only = report("wordy", "1.0", test + "E   AssertionError", 0)
    base = repo_cache().base("me/wordy", repo, row["base_commit"])
    assert frame(through, base) == ("wordy/text.py", 9) and frame(tests_only, base) is None
    assert frame(elsewhere, base) == ("wordy/__init__.py", 1)
    none = next(f"me__wordy-{i}" for i in range(100)
                if recovery({"instance_id": f"me__wordy-{i}"}) == RECOVERIES[0])
    env = SWEEnv(max_turns=10)
    try:
        led, other, searched = (swe_demo(dict(row, repo_path=str(repo), problem_statement=s,
                                              instance_id=none), env)
                                for s in (through, elsewhere, tests_only))
        again = [replay_demo(d, env) for d in (led, other)]
    finally:
        env.close()
    assert all(a["reward"] == 1.0 and a["info"]["format_valid"] == 1.0 for a in again)
    assert len(led["actions"]) == 4 and "grep -r" not in "".join(led["actions"])
    assert "The traceback goes through line 9 of wordy/text.py; I open it there." in \
        led["actions"][0] and view_at("wordy/text.py", 9) in led["actions"][0]
    assert "     9\t    return len(text.split(\" \"))" in led["observations"][0][0]["content"]
    assert "The traceback goes through line 1 of wordy/__init__.py; I open it there." in \
        other["actions"][0] and view_at("wordy/__init__.py", 1) in other["actions"][0]
    # the frame's line names more words than the statement did: the search may be another
    assert "grep -rn" in other["actions"][1] and len(other["actions"]) == 6
    assert other["actions"][-3:] == searched["actions"][-3:]  # the edit, tests, submit
    assert 'grep -rnE "(def|class) count_words\\b"' in searched["actions"][0]


def test_a_failing_checks_name_leads_the_search_where_the_traceback_shows_only_tests(
        user_repo):
    """Where the traceback goes through test files only, the search is for the first word
    of the failing check's name whose listing leads above the edit (``test_text_split``:
    where ``text`` is used), whatever the instance id (no empty search first); a check's
    name that leads nowhere falls back on the statement's names."""
    from agentgym.data.demos import replay_demo
    from agentgym.envs.swe import SWEEnv
    from agentgym.envs.swe_demos import RECOVERIES, recovery, swe_demo
    from agentgym.envs.swe_make import report
    repo, row = user_repo

    def tests_only(check: str) -> str:
        return report("wordy", "1.0", f"tests/test_text.py:5: in {check}\n"
                      "    assert count_words(\"a  b \") == 2\nE   AssertionError", 0)

    ids = {k: next(f"me__wordy-{i}" for i in range(100)
                   if recovery({"instance_id": f"me__wordy-{i}"}) == k) for k in RECOVERIES}
    env = SWEEnv(max_turns=10)
    try:
        named = [swe_demo(dict(row, repo_path=str(repo), problem_statement=tests_only(
            "test_text_split"), instance_id=i), env) for i in ids.values()]
        fallback = swe_demo(dict(row, repo_path=str(repo), problem_statement=tests_only(
            "test_spaces"), instance_id=ids["none"]), env)
        again = replay_demo(named[1], env)
    finally:
        env.close()
    assert again["reward"] == 1.0 and again["info"]["format_valid"] == 1.0
    for d in named:
        assert d["recovery"] == "none" and len(d["actions"]) == 5
        assert "THOUGHT: The failing check is test_text_split; I look for where text is " \
            "used." in d["actions"][0] and 'grep -rnw "text"' in d["actions"][0]
        assert "./wordy/text.py:9:" in d["observations"][0][0]["content"]
        assert "text is at line 9 of wordy/text.py" in d["actions"][1]
    assert 'grep -rnE "(def|class) count_words\\b"' in fallback["actions"][0]


def test_a_patch_that_does_not_resolve_gives_no_demonstration(user_repo):
    """The builder keeps only what the env grades resolved: a 'gold' patch that edits the
    wrong function (the tests it runs fail) gives no demonstration, and nor does a statement
    that names nothing the patched file defines."""
    import difflib
    from agentgym.envs.swe import SWEEnv
    from agentgym.envs.swe_demos import swe_demo
    repo, row = user_repo
    wrong = SRC.replace('"!"', '"?"')
    patch = "diff --git a/wordy/text.py b/wordy/text.py\n" + "".join(difflib.unified_diff(
        SRC.splitlines(True), wrong.splitlines(True), "a/wordy/text.py", "b/wordy/text.py"))
    env = SWEEnv()
    try:
        assert swe_demo(dict(row, repo_path=str(repo)), env) is not None  # the real one
        assert swe_demo(dict(row, repo_path=str(repo), patch=patch), env) is None
        assert swe_demo(dict(row, repo_path=str(repo),
                             problem_statement="The program is wrong."), env) is None
    finally:
        env.close()


def test_a_demonstration_never_searches_for_the_statements_own_words(tmp_path):
    """The statement's template (``This check fails``, ``It should pass``, ``other
    check(s)``) and a code fence's language say nothing of the bug: a search for one lists
    a comment that happens to use it. With a comment using them just above the bug and
    nothing else of the statement in the source, no name leads to the edit; with the
    statement's code calling a function of the file, that function's ``def`` does."""
    from agentgym.envs.swe_demos import _locate, _missing
    from agentgym.envs.swe_make import END, HEAD, MORE, STATEMENT_WORDS
    assert {"should", "check", "other", "package"} <= STATEMENT_WORDS
    src = ("def total(xs):\n"
           "    # This should pass the same way for other python packages\n"
           "    return sum(xs) + 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core.py").write_text(src)

    def said(code: str) -> str:
        return (HEAD.format(name="pkg", version="1.0") + f"\n\n```python\n{code}\n```\n\n"
                "with:\n\n```\nAssertionError\n```\n\n" + END + "\n\n" + MORE.format(n=2))
    helper = said("assert_equal(expected, result)")
    assert _locate(helper, tmp_path, "pkg/core.py", src, 3) is None
    assert _missing(helper, tmp_path) == "assert_equal"
    assert _locate(said("assert total([1]) == 1"), tmp_path, "pkg/core.py", src, 3) == \
        ("total", True, 1)


# -- the shipped tasks (data/swe: made by agentgym swe make-tasks) -------------------------
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "swe"
SHIPPED_CAP = 4 << 20  # bytes: the tracked tree travels to a lent GPU in 64 MiB calls


def _shipped() -> dict[str, list[dict]]:
    from agentgym.data.rows import read_rows
    return {split: read_rows(SHIPPED / f"{split}.jsonl.gz") for split in ("train", "test")}


def test_the_shipped_tasks_are_enough_split_by_repository_and_small():
    """At least 300 tasks from at least 6 repositories, the held-out split (at least 100)
    whole repositories the training split never sees, each repository a bundle here, ids
    unique, and the folder under its size cap."""
    rows = _shipped()
    every = rows["train"] + rows["test"]
    repos = {split: {r["repo"] for r in found} for split, found in rows.items()}
    assert len(every) >= 300 and len(rows["test"]) >= 100
    assert len(repos["train"] | repos["test"]) >= 6 and not repos["train"] & repos["test"]
    assert len({r["instance_id"] for r in every}) == len(every)
    bundles = {p.name for p in (SHIPPED / "repos").iterdir()}
    assert bundles == {f"{r.replace('/', '__')}.bundle" for r in repos["train"] | repos["test"]}
    size = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert size <= SHIPPED_CAP, f"data/swe holds {size} bytes, over its cap of {SHIPPED_CAP}"
    for r in every:  # each loads as the env takes it; none is a Docker task
        assert adapt_row(r, r["instance_id"])["FAIL_TO_PASS"]


def test_no_statement_names_the_bug_unless_its_traceback_does():
    """A shipped problem statement says what fails, never where the bug is: the mutated
    file, its function and the mutated line's text appear in it only where the failing
    test's own traceback shows them (a function named as its package is, tabulate's
    ``tabulate``, is named by the statement's first line); and no statement quotes the gold
    patch's lines."""
    for r in _shipped()["train"] + _shipped()["test"]:
        text, shown, m = r["problem_statement"], r["failing_traceback"], r["mutation"]
        package = r["repo"].split("/")[-1]
        fixed = [ln[1:].strip() for ln in r["patch"].splitlines()
                 if ln.startswith("+") and not ln.startswith("+++") and len(ln.strip()) > 8]
        for clue in (Path(m["file"]).name, m["function"].rsplit(".", 1)[-1], *fixed):
            if clue != package:
                assert clue not in text or clue in shown, (r["instance_id"], clue)


def test_one_shipped_task_of_each_repository_resolves_with_its_patch_and_not_without(
        tmp_path, capsys):
    """`agentgym swe validate` over the first shipped task of each repository (the shipped
    bundles, found by the row's repo): the gold patch resolves, an empty diff does not."""
    rows = _shipped()
    first = {}
    for r in rows["train"] + rows["test"]:
        first.setdefault(r["repo"], r)
    write_jsonl(tmp_path / "sample.jsonl", first.values())
    assert cli(["swe", "validate", f"data={tmp_path / 'sample.jsonl'}"]) == 0
    out = capsys.readouterr().out
    assert f"{len(first)} of {len(first)} rows valid" in out


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "test"])
def test_every_shipped_task_resolves_with_its_patch_and_not_without(split, capsys):
    assert cli(["swe", "validate", f"data={split}"]) == 0, capsys.readouterr().out[-3000:]
