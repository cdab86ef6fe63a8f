"""What envs call: the retriever client and its local launcher, the code sandbox, MCP."""

from agentgym._compat import serve_old_name

serve_old_name(__name__)  # `import tools`, the old name: it now is agentgym.tools
