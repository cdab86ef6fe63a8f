"""An MCP server's tools, for envs: one connection through the official ``mcp`` SDK, held
open in a background thread for as long as the run lasts.

``command`` launches the server as a subprocess and speaks MCP over its stdin/stdout
(``mcp.command="python my_server.py"``); ``url`` reaches one over streamable HTTP
(``mcp.url=http://host:8000/mcp``). :meth:`MCPTools.schemas` are the server's tools as
OpenAI function schemas (their JSON input schemas unchanged); :meth:`MCPTools.call` runs
one from any thread and returns its text. A tool that reports an error returns it
(``is_error``); a server that cannot be reached or stops answering raises
:class:`~agentgym.tools.errors.ToolUnavailable` / :class:`~agentgym.tools.errors.ToolTimeout`.

:func:`shared` keeps one connection per server per process (every env of a run shares
it) and closes it at exit: the server lives as long as the run.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import shlex
import sys
import tempfile
import threading

from agentgym.supervision.supervisor import ServiceFailed
from agentgym.tools.errors import MissingExtra, ToolTimeout, ToolUnavailable

logger = logging.getLogger(__name__)

#: the calculator every ``env=mcp`` without ``mcp.command`` / ``mcp.url`` talks to
DEFAULT_COMMAND = f"{shlex.quote(sys.executable)} -m agentgym.tools.mcp_calculator"


class MCPServerFailed(ServiceFailed, ToolUnavailable):
    """The MCP server did not start or answer its first request (the run cannot start)."""


def _needs_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise MissingExtra("env=mcp needs the mcp package: pip install -e '.[mcp]' in the checkout") from e


class MCPTools:
    """One MCP server, connected (see the module docstring)."""

    def __init__(self, command: str = "", url: str = "", timeout_s: float = 30.0,
                 connect_timeout_s: float = 60.0) -> None:
        if bool(command) == bool(url):
            raise ValueError(f"an MCP server needs exactly one of mcp.command (stdio) and "
                             f"mcp.url (streamable HTTP); got command={command!r}, "
                             f"url={url!r}")
        _needs_mcp()
        self.where = command or url
        self.command, self.url, self.timeout_s = command, url, timeout_s
        # a stdio server's stderr (its logs, tracebacks): a file, its tail in a start error
        self._errlog = tempfile.NamedTemporaryFile("w+", prefix="mcp-server-", suffix=".log",
                                                   encoding="utf-8", errors="replace")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="mcp-client")
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._client = None
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._hold(ready), self._loop)
        try:
            listed = ready.result(timeout=connect_timeout_s)
        except Exception as e:
            self._errlog.seek(0)
            said = self._errlog.read()[-1500:].strip()
            self.close()
            raise MCPServerFailed(f"MCP server {self.where!r} did not start or answer "
                                  f"within {connect_timeout_s:.0f} s: {type(e).__name__}: {e}"
                                  + (f"; its stderr ends:\n{said}" if said else "")) from e
        self.schemas = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema or {"type": "object", "properties": {}}}}
            for t in listed]
        logger.info("MCP server %s: tools %s", self.where, [t.name for t in listed])

    def _server(self):
        if self.url:
            return self.url
        from mcp.client.stdio import StdioServerParameters, stdio_client
        argv = shlex.split(self.command)
        return stdio_client(StdioServerParameters(command=argv[0], args=argv[1:]),
                            errlog=self._errlog)

    async def _hold(self, ready: concurrent.futures.Future) -> None:
        """Connect, list the tools, then keep the connection until :meth:`close`."""
        from mcp import Client
        self._stop = asyncio.Event()
        try:
            async with Client(self._server(), read_timeout_seconds=self.timeout_s) as client:
                self._client = client
                ready.set_result((await client.list_tools()).tools)
                await self._stop.wait()
        except BaseException as e:
            if not ready.done():
                ready.set_exception(e)
            raise
        finally:
            self._client = None

    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """``(text, is_error)`` of one call: the result's text parts (other parts as
        JSON), or the server's error message."""
        if self._client is None:
            raise ToolUnavailable(f"MCP server {self.where!r} is not connected")
        future = asyncio.run_coroutine_threadsafe(
            self._client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s),
            self._loop)
        try:
            result = future.result(timeout=self.timeout_s + 5)
        except (TimeoutError, concurrent.futures.TimeoutError) as e:
            future.cancel()
            raise ToolTimeout(f"MCP tool {name} did not answer within "
                              f"{self.timeout_s:.0f} s") from e
        except Exception as e:  # the connection broke (the server died, HTTP failed)
            raise ToolUnavailable(f"MCP server {self.where!r}: {type(e).__name__}: {e}") from e
        parts = [getattr(p, "text", None) if getattr(p, "type", "") == "text"
                 else json.dumps(p.model_dump(mode="json"), ensure_ascii=False)
                 for p in result.content]
        return "\n".join(p for p in parts if p is not None), bool(result.is_error)

    def close(self) -> None:
        """End the connection (a stdio server's process with it). Idempotent."""
        if self._loop.is_closed():
            return
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._main.result(timeout=30)
        except Exception as e:  # noqa: BLE001 - closing: report, do not raise
            logger.debug("MCP client of %s ended with %s", self.where, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        self._errlog.close()


_SHARED: dict[tuple[str, str, float], MCPTools] = {}
_LOCK = threading.Lock()


def shared(command: str = "", url: str = "", timeout_s: float = 30.0) -> MCPTools:
    """The process's one connection to this server (made on first use, closed at exit);
    the calculator of :mod:`agentgym.tools.mcp_calculator` when neither is given."""
    if not command and not url:
        command = DEFAULT_COMMAND
    key = (command, url, timeout_s)
    with _LOCK:
        if key not in _SHARED:
            _SHARED[key] = MCPTools(command, url, timeout_s)
            atexit.register(_SHARED[key].close)
        return _SHARED[key]


def close_shared() -> None:
    """Close every shared connection now (a run that ends before its process)."""
    with _LOCK:
        for tools in _SHARED.values():
            tools.close()
        _SHARED.clear()

