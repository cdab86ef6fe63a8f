"""An env's own commands (``agentgym swe validate data=FILE``): the run's config and, for a
command that takes them, the rows of ``data=`` built here, then the command run
(:attr:`agentgym.envs.manifest.EnvManifest.commands`). The CLI prints what it yields."""

from __future__ import annotations

from collections.abc import Generator

from agentgym.config import build_config
from agentgym.core.overrides import parse_overrides
from agentgym.data.rows import load_rows
from agentgym import envs
from agentgym.envs.manifest import takes_rows


def env_command(env: str, name: str, args: list[str]) -> Generator[str, None, int]:
    """``agentgym NAME SUBCOMMAND key=value ...`` of env ``env``: yields the report's lines,
    returns its exit status. Raises ValueError for an unknown subcommand or missing data."""
    manifest = envs.env_manifest(env)
    subs = manifest.commands[name]
    if not args or args[0] not in subs:
        raise ValueError(f"usage: agentgym {name} {{{','.join(subs)}}} key=value ...")
    fn, keys = subs[args[0]], parse_overrides(args[1:])
    cfg = build_config({**keys, "env": env})
    lead = []
    if takes_rows(fn):
        if "data" not in keys and "data.name" not in keys:
            raise ValueError(f"agentgym {name} {args[0]} needs data=FILE (or a dataset name)")
        lead = [load_rows(env, cfg.data.name, cfg.limit, cfg)]
    return (yield from manifest.call(fn, cfg, *lead))
