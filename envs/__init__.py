"""AgentGym environments. Importing this package registers them with AgentGym and with
gymnasium: ``import agentgym.envs; gymnasium.make("agentgym/Search-v0")`` (also
``agentgym/Code-v0``, ``agentgym/Geometry-v0``, ``agentgym/MCP-v0``). Each env is one module
of this folder whose class names its id (``class SearchEnv(AgentEnv,
env_id="agentgym/Search-v0", short="search")``) and whose ``MANIFEST`` says what the trainer
asks of it (:func:`env_manifest`); :func:`discover_envs` imports them all."""

from agentgym.envs.base import AgentEnv, MessagesSpace, TextSpace
from agentgym.envs.checker import EnvContractError, check_env
from agentgym.envs.manifest import EnvManifest
from agentgym.envs.registration import (config_sections, default_env, discover_envs,
                                        env_aliases, env_commands, env_class, env_ids, env_manifest,
                                        make_env, register_entry_points, register_env,
                                        resolve_env_id, short_name, short_names)

discover_envs()  # every module of this folder: each env class registers itself
register_entry_points()  # installed packages' envs (group agentgym.envs, envs.plugins)

__all__ = ["AgentEnv", "MessagesSpace", "TextSpace", "EnvContractError", "EnvManifest",
           "check_env", "config_sections", "default_env", "discover_envs", "env_aliases", "env_commands",
           "env_class", "env_ids", "env_manifest", "make_env", "register_entry_points",
           "register_env", "resolve_env_id", "short_name", "short_names"]
