"""AgentGym environments. Importing this package registers them (lazily) with AgentGym
and with gymnasium: ``import envs; gymnasium.make("agentgym/Search-v0")``
(also ``agentgym/Code-v0``, ``agentgym/Geometry-v0``, ``agentgym/MCP-v0``)."""

from envs.base import AgentEnv, MessagesSpace, TextSpace
from envs.checker import EnvContractError, check_env
from envs.registration import (env_aliases, env_ids, make_env, register_entry_points,
                               register_env, resolve_env_id, short_name, short_names)

register_env("agentgym/Search-v0", "envs.search:SearchEnv", short="search")
register_env("agentgym/Code-v0", "envs.code:CodeEnv", short="code")
register_env("agentgym/Geometry-v0", "envs.geometry:GeometryEnv", short="geometry")
register_env("agentgym/MCP-v0", "envs.mcp_env:MCPEnv", short="mcp")
register_env("agentgym/Agent-v0", "envs.agent_program:AgentProgram", short="agent")
register_entry_points()  # installed packages' envs (group agentgym.envs, envs.plugins)

__all__ = ["AgentEnv", "MessagesSpace", "TextSpace", "EnvContractError", "check_env",
           "env_aliases", "env_ids", "make_env", "register_entry_points", "register_env",
           "resolve_env_id", "short_name", "short_names"]
