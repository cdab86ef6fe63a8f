"""What envs call: the retriever client and its local launcher, the code sandbox, MCP."""
