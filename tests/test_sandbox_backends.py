"""The code sandbox's other ways in (tools/sandbox*.py): the ``unshare`` fallback when
bubblewrap is missing (and its documented weakness), construction from a config, E2B's
results mapped to ours (no network), the ``agentgym sandbox exec`` CLI, and ExecResult.
The local tests need root, some also bubblewrap."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import sys
import threading
import uuid
from pathlib import Path

import pytest
from sandbox_probes import LIMITS, ROOT, assert_still_works, needs_bwrap, needs_root
from sandbox_probes import make  # noqa: F401, F811 (a fixture)

from agentgym.cli import main as cli_main
from agentgym.tools import sandbox_local
from agentgym.tools.sandbox import (E2BSandbox, ExecResult, Limits, LocalSandbox,
                                    SandboxConfig, make_sandbox)


# ---- construction, fallback -------------------------------------------------------------
def _no_bwrap(monkeypatch):
    real = sandbox_local.shutil.which
    monkeypatch.setattr(sandbox_local.shutil, "which",
                        lambda name: None if name == "bwrap" else real(name))


@needs_root
def test_missing_bwrap_fails_fast_with_the_fix(monkeypatch):
    _no_bwrap(monkeypatch)  # a fake, to inject the fault "bwrap is not installed"
    with pytest.raises(ValueError, match="apt-get install bubblewrap"):
        LocalSandbox(isolation="bwrap")


@needs_root
def test_auto_falls_back_to_unshare_with_a_warning(monkeypatch, caplog):
    _no_bwrap(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="agentgym.tools.sandbox_local"):
        sb = LocalSandbox(Limits(**LIMITS), isolation="auto")
    try:
        assert sb.backend == "unshare" and "FILESYSTEM stays visible" in caplog.text
        assert sb.run_sync("print(1)").stdout == "1\n"
    finally:
        sb.close()


@needs_root
def test_unshare_blocks_network(make):
    sb = make(isolation="unshare")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        r = sb.run_sync(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', "
                        f"{listener.getsockname()[1]}), timeout=2)\n    print('CONNECTED')\n"
                        f"except OSError as e:\n    print('blocked', type(e).__name__)")
        assert r.backend == "unshare" and r.stdout.startswith("blocked"), r
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert_still_works(sb)


@needs_root
def test_unshare_clears_environment_and_drops_root(make, monkeypatch):
    monkeypatch.setenv("AGENTGYM_TEST_SECRET", "s3cret")
    sb = make(isolation="unshare")
    r = sb.run_sync("import json, os\nprint(os.getuid(), json.dumps(dict(os.environ)))")
    uid, env = r.stdout.split(" ", 1)
    assert int(uid) >= sandbox_local.UID_BASE
    assert set(json.loads(env)) - {"PWD", "OLDPWD"} <= set(sandbox_local.ENV)
    assert "s3cret" not in env


@needs_root
def test_unshare_has_private_tmp(make):
    sb = make(isolation="unshare")
    name = f"/tmp/sandbox-probe-{uuid.uuid4().hex}"
    r = sb.run_sync(f"open({name!r}, 'w').write('x')\nprint('wrote')")
    assert r.stdout == "wrote\n" and not os.path.exists(name), r


@needs_root
def test_unshare_is_weaker_host_files_stay_readable(make):
    # Documented weakness of the fallback: no filesystem isolation beyond the tmpfs dirs.
    sb = make(isolation="unshare")
    # (a checkout under /tmp is itself behind the fallback's private /tmp: probe /opt then)
    where = Path("/opt") if str(ROOT).startswith(("/tmp/", "/var/tmp/")) else ROOT
    probe = where / f".sandbox-probe-{uuid.uuid4().hex}"
    probe.write_text("visible")
    try:
        r = sb.run_sync(f"print(open({str(probe)!r}).read())")
    finally:
        probe.unlink()
    assert r.ok and r.stdout == "visible\n", r


# ---- config and construction ------------------------------------------------------------
@needs_bwrap
def test_explicit_interpreter_is_bound_read_only():
    sb = LocalSandbox(Limits(**LIMITS), python=os.path.join(sys.prefix, "bin", "python"))
    try:
        r = sb.run_sync("import sys, numpy\nprint(sys.prefix)\n"
                        "open(sys.prefix + '/probe', 'w')")
        assert r.stdout == f"{sys.prefix}\n" and "Read-only file system" in r.stderr, r
    finally:
        sb.close()


@needs_root
def test_unrunnable_interpreter_fails_fast():
    with pytest.raises(ValueError, match="cannot be run"):
        LocalSandbox(python="/nonexistent/python")


def test_limits_reject_non_positive_values():
    with pytest.raises(ValueError, match="wall_s"):
        Limits(wall_s=0)


@needs_bwrap
def test_make_sandbox_from_config():
    sb = make_sandbox(SandboxConfig(wall_s=3.0, memory_mb=300, max_concurrency=2))
    try:
        assert isinstance(sb, LocalSandbox) and sb.max_concurrency == 2
        assert sb.limits == Limits(wall_s=3.0, memory_mb=300)
        assert sb.run_sync("print('hi')").stdout == "hi\n"
    finally:
        sb.close()


# ---- E2B --------------------------------------------------------------------------------
def test_e2b_without_key_fails_fast(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(ValueError, match="E2B_API_KEY.*sandbox.backend=local"):
        E2BSandbox()
    with pytest.raises(ValueError, match="E2B_API_KEY"):
        make_sandbox(SandboxConfig(backend="e2b"))


def test_e2b_with_key_constructs_without_network(monkeypatch):
    pytest.importorskip("e2b_code_interpreter")
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    sb = E2BSandbox(api_key="e2b_test_not_a_real_key")
    sb.close()
    sb.close()
    assert sb.backend == "e2b"


def test_e2b_maps_a_successful_execution():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, Logs, Result

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(results=[Result(text="42", is_main_result=True)],
                   logs=Logs(stdout=["a\n", "b\n"], stderr=["warn\n"]), execution_count=1)
    r = execution_to_result(ex, Limits(), 0.5)
    assert (r.stdout, r.stderr, r.exit_code, r.ok, r.backend) == ("a\nb\n42\n", "warn\n", 0,
                                                                  True, "e2b")


def test_e2b_maps_an_error_with_its_traceback():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, ExecutionError, Logs

    from agentgym.tools.sandbox_e2b import execution_to_result
    tb = "\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"
    ex = Execution(logs=Logs(stdout=["before\n"]),
                   error=ExecutionError("ZeroDivisionError", "division by zero", tb))
    r = execution_to_result(ex, Limits(), 0.1)
    assert r.exit_code == 1 and not r.ok and not r.memory_exceeded
    assert r.stdout == "before\n" and r.stderr == "ZeroDivisionError: division by zero\n"


def test_e2b_maps_memory_error():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, ExecutionError

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(error=ExecutionError("MemoryError", "", "MemoryError"))
    assert execution_to_result(ex, Limits(), 0.1).memory_exceeded


def test_e2b_output_is_capped_like_local():
    pytest.importorskip("e2b_code_interpreter")
    from e2b_code_interpreter.models import Execution, Logs

    from agentgym.tools.sandbox_e2b import execution_to_result
    ex = Execution(logs=Logs(stdout=["é" * 100]))  # 200 bytes of 2-byte characters
    r = execution_to_result(ex, Limits(max_output_bytes=51), 0.1)
    assert r.truncated and r.stdout == "é" * 25  # the character cut by the cap is dropped


# ---- CLI --------------------------------------------------------------------------------
@needs_bwrap
def test_cli_sandbox_exec_file(tmp_path, capsys):
    code = tmp_path / "cell.py"
    code.write_text("print('from file')\n1 / 0\n")
    assert cli_main(["sandbox", "exec", "--file", str(code), "sandbox.wall_s=5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stdout"] == "from file\n" and out["exit_code"] == 1
    assert "ZeroDivisionError" in out["stderr"] and out["backend"] == "bwrap"


@needs_bwrap
def test_cli_sandbox_exec_stdin(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x = 20\nx + 22\n"))
    assert cli_main(["sandbox", "exec", "-", "--session", "cli"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stdout"] == "42\n" and out["exit_code"] == 0 and out["error"] == ""


def test_cli_sandbox_rejects_other_overrides(capsys):
    assert cli_main(["sandbox", "exec", "--file", "x.py", "model=tiny"]) == 2
    assert "only sandbox.* overrides" in capsys.readouterr().err


def test_cli_sandbox_rejects_bad_values(capsys):
    assert cli_main(["sandbox", "exec", "--file", "x.py", "sandbox.wall_s=-1"]) == 2
    assert "wall_s" in capsys.readouterr().err


def test_cli_sandbox_usage_error():
    assert cli_main(["sandbox", "run"]) == 2


def test_result_dict_round_trip():
    r = ExecResult("o", "e", 0, False, False, False, 0.1, "bwrap")
    assert ExecResult(**r.to_dict()) == r and r.ok
    assert not ExecResult.failure("x", "bwrap").ok


def test_no_thread_left_behind_by_failed_construction(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    before = threading.active_count()
    with pytest.raises(ValueError):
        E2BSandbox()
    assert threading.active_count() == before
