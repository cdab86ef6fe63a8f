"""Exceptions raised by tools (retriever client, sandbox).

Environments catch :class:`ToolError` and turn it into an observation plus an info
counter; a tool failure never ends a training run.
"""

from __future__ import annotations


class ToolError(Exception):
    """A tool call failed. Base class; also raised for a malformed tool response."""


class ToolTimeout(ToolError):
    """The tool did not answer within its timeout (after any retries)."""


class ToolUnavailable(ToolError):
    """The tool could not be reached or kept failing: connection refused or dropped, or a
    5xx answer, after retries."""


class ToolBadRequest(ToolError):
    """The tool rejected the call as invalid (a 4xx answer); retrying cannot help."""


class MissingExtra(ImportError):
    """A tool needs an optional package that is not installed; the message says which
    ``pip install`` adds it (``agentgym check-env`` reports such an env as skipped)."""
