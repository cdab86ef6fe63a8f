"""Start rollout servers as subprocesses: SGLang on a GPU machine, ``agentgym serve`` anywhere.

Both come back as a :class:`~agentgym.supervision.server_process.ServerProcess` that is healthy
(``GET /health`` answers 200; SGLang answers 503 until its warm-up generation is done) and
stops with :meth:`~agentgym.supervision.server_process.ServerProcess.stop`.

Example (GPU machine with ``pip install "sglang[all]"``)::

    server = launch_sglang("/models/Qwen2.5-0.5B-Instruct", port=30000)
    engine = SGLangEngine([server.url], tokenizer)
    ...
    server.stop()

The SGLang flags (``docs/advanced_features/server_arguments.md``): ``--model-path``,
``--host``, ``--port``, ``--dtype``, ``--random-seed``, ``--tp-size``,
``--mem-fraction-static``, ``--skip-tokenizer-init`` (token-in/token-out; the client then
applies stop strings itself), ``--enable-deterministic-inference`` (makes
``sampling_seed`` count; needs the flashinfer, fa3 or triton attention backend).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from agentgym.core.paths import repo_root
from agentgym.supervision.server_process import ServerProcess, free_port
from agentgym.core.device import cuda_available


def sglang_command(model_path: str, port: int, host: str = "127.0.0.1", dtype: str = "auto",
                   seed: int | None = None, tp_size: int = 1,
                   mem_fraction_static: float | None = None, skip_tokenizer_init: bool = True,
                   deterministic: bool = False, extra_args: list[str] | tuple = ()) -> list[str]:
    """The ``python -m sglang.launch_server`` command line for a rollout server."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
           "--host", host, "--port", str(port), "--dtype", dtype or "auto",
           "--tp-size", str(tp_size), "--log-level", "warning"]
    if seed is not None:
        cmd += ["--random-seed", str(seed)]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if deterministic:
        cmd.append("--enable-deterministic-inference")
    return cmd + list(extra_args)


def launch_sglang(model_path: str, port: int | None = None, host: str = "127.0.0.1",
                  startup_timeout: float = 900.0, **kwargs) -> ServerProcess:
    """Start an SGLang server for ``model_path`` and wait until it is healthy.

    Raises:
        RuntimeError: sglang is not installed, there is no CUDA device, or the server
            exited during start-up (with the tail of its log).
        TimeoutError: it was not healthy within ``startup_timeout`` seconds.
    """
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("engine=sglang with no engine.urls launches an SGLang server, but "
                           "sglang is not installed (pip install \"sglang[all]\" on a GPU "
                           "machine); or point engine.urls at running servers (SGLang, or "
                           "`agentgym serve --model ... --port ...` on CPU)")
    if not cuda_available():
        raise RuntimeError("SGLang servers need a CUDA GPU and this machine has none; run "
                           "`agentgym serve --model ... --port ...` and pass engine.urls=[...]")
    port = port or free_port()
    server = ServerProcess(sglang_command(model_path, port, host, **kwargs),
                           f"http://{host}:{port}", name="sglang server",
                           startup_timeout=startup_timeout, stop_grace_s=30.0)
    server.start()
    return server


def serve_command(model: str, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                  extra_args: list[str] | tuple = ()) -> list[str]:
    """The ``agentgym serve`` command line (the HF engine behind SGLang's API)."""
    return [sys.executable, "-m", "agentgym.cli", "serve", "--model", str(model), "--host",
            host, "--port", str(port), "--dtype", dtype, *extra_args]


def launch_serve(model: str, port: int | None = None, host: str = "127.0.0.1",
                 dtype: str = "float32", extra_args: list[str] | tuple = (),
                 startup_timeout: float = 300.0) -> ServerProcess:
    """Start ``agentgym serve`` for ``model`` and wait until it is healthy."""
    port = port or free_port()
    server = ServerProcess(serve_command(model, port, host, dtype, extra_args),
                           f"http://{host}:{port}", name="agentgym serve",
                           startup_timeout=startup_timeout,
                           env={"PYTHONPATH": os.pathsep.join(
                               p for p in (str(repo_root()), os.environ.get("PYTHONPATH")) if p)})
    server.start()
    return server
