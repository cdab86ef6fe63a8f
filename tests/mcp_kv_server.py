"""A real MCP server for the tests, written with the official SDK: a key-value store
(``lookup``), and a tool that always fails (``explode``). ``--pid-file F`` writes its
process id there (so a test can see it live and end); ``--http PORT`` serves streamable
HTTP instead of stdio."""

from __future__ import annotations

import argparse
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

CAPITALS = {"france": "Paris", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima"}
server = MCPServer("agentgym-test-kv")


@server.tool()
def lookup(key: str) -> str:
    """The capital city of a country (lower-case name)."""
    if key.lower() not in CAPITALS:
        raise ToolError(f"no entry for {key!r}; known: {', '.join(CAPITALS)}")  # sent as is
    return CAPITALS[key.lower()]


@server.custom_route("/health", methods=["GET"])
async def health(request):  # what ServerProcess polls before a test connects over HTTP
    from starlette.responses import PlainTextResponse
    return PlainTextResponse("ok")


@server.tool()
def explode(reason: str) -> str:
    """Always fails (a crash: the SDK hides its message from the client)."""
    raise RuntimeError(f"exploded: {reason}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid-file", default="")
    parser.add_argument("--http", type=int, default=0)
    args = parser.parse_args()
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(os.getpid()))
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run()
