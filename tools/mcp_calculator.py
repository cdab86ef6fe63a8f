"""A calculator served over MCP (stdio), written with the official ``mcp`` SDK: the server
``env=mcp`` talks to when no ``mcp.command`` / ``mcp.url`` is given, and an example of
the shape any MCP server has. Run it alone with ``python -m agentgym.tools.mcp_calculator``."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("agentgym-calculator")


@server.tool()
def add(a: float, b: float) -> float:
    """Return a + b."""
    return a + b


@server.tool()
def subtract(a: float, b: float) -> float:
    """Return a - b."""
    return a - b


@server.tool()
def multiply(a: float, b: float) -> float:
    """Return a * b."""
    return a * b


@server.tool()
def divide(a: float, b: float) -> float:
    """Return a / b (b must not be 0)."""
    if b == 0:
        raise ToolError("division by zero")  # the message reaches the model
    return a / b


if __name__ == "__main__":
    server.run()
