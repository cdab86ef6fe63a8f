"""Environment registry: AgentGym ids, short names, and registration with gymnasium.

``register_env("agentgym/Search-v0", "agentgym.envs.search:SearchEnv", short="search")`` records a
lazy entry point (the module is imported only on ``make_env``) and registers the same id
with gymnasium, so ``gymnasium.make("agentgym/Search-v0")`` works after ``import envs``.
Ids carry a version: bump it whenever reward, parsing or prompt changes could move results.
"""

from __future__ import annotations

import re

import gymnasium

from agentgym.core.registry import Registry, did_you_mean
from agentgym.envs.manifest import EMPTY, EnvManifest, manifest_of
from agentgym.envs.base import AgentEnv
from agentgym.envs.plugins import entry_point_envs, is_spec, plugin_env_class, plugin_env_id

ENVS: Registry = Registry("environment")
_SHORT: dict[str, str] = {}
_ID = re.compile(r"^[\w.-]+/[\w.-]+-v\d+$")


def register_env(env_id: str, entry_point: str, short: str | None = None, **kwargs) -> None:
    """Register ``env_id`` (``namespace/Name-vN``) with AgentGym and gymnasium.

    Args:
        env_id: versioned id, e.g. ``agentgym/Search-v0``.
        entry_point: lazy ``"package.module:Class"``.
        short: optional short name for the CLI (``env=search``).
        kwargs: default constructor arguments.
    """
    if not _ID.match(env_id):
        raise ValueError(f"environment id {env_id!r} must look like 'namespace/Name-vN'")
    if short is not None and short in _SHORT:
        raise ValueError(f"short name {short!r} already names {_SHORT[short]!r}")
    ENVS.register(env_id, entry_point, short=short, kwargs=dict(kwargs))
    if short is not None:
        _SHORT[short] = env_id
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=entry_point, kwargs=dict(kwargs))


def resolve_env_id(name: str) -> str:
    """Map a short name (``search``), a full id, or a ``package.module:Class`` plugin
    spec (registered on first use, :mod:`agentgym.envs.plugins`) to the registered full id."""
    if name in ENVS:
        return name
    if name in _SHORT:
        return _SHORT[name]
    if is_spec(name):
        cls = plugin_env_class(name)
        env_id = plugin_env_id(cls, name.partition(":")[0].split(".")[0])
        if env_id in ENVS:  # the same class registered under another name
            _SHORT.setdefault(name, env_id)
            return env_id
        register_env(env_id, name, short=name)
        return env_id
    choices = sorted(_SHORT) + ENVS.names()
    raise KeyError(f"unknown environment {name!r}{did_you_mean(name, choices)}; "
                   f"valid: {', '.join(choices)}")


def make_env(name: str, **kwargs):
    """Instantiate a registered env (short name or full id) with overrides ``kwargs``."""
    env_id = resolve_env_id(name)
    cls = ENVS.get(env_id)
    return cls(**{**ENVS.extras(env_id)["kwargs"], **kwargs})


def env_class(name: str) -> type:
    """The class of a registered env (short name, full id or plugin spec); imports it."""
    return ENVS.get(resolve_env_id(name))


def discovered() -> list[type]:
    """The env classes :func:`discover_envs` registered from this package, in id order."""
    return [_DISCOVERED[i] for i in sorted(_DISCOVERED)]


def env_manifest(name: str) -> EnvManifest:
    """What the trainer asks of a registered env (short name, full id or plugin spec): the
    ``MANIFEST`` its module declares (:mod:`agentgym.envs.manifest`); imports it."""
    return manifest_of(env_class(name))


def config_sections() -> dict[str, type]:
    """Every config section the discovered envs own (their manifests' ``sections``): the
    run's config has them all, whichever env it plays (a mixed run plays several)."""
    out: dict[str, type] = {}
    for cls in discovered():
        for name, section in manifest_of(cls).sections.items():
            if out.setdefault(name, section) is not section:
                raise ValueError(f"config section {name!r} of {cls.__name__} is already "
                                 f"{out[name].__name__}'s; an env needs a name of its own")
    return out


def env_commands() -> dict[str, str]:
    """``agentgym NAME`` commands the discovered envs bring (their manifests'
    ``commands``): NAME -> the short name of the env that brings it."""
    out: dict[str, str] = {}
    for cls in discovered():
        env = cls.env_short or cls.env_id
        for name in manifest_of(cls).commands:
            if out.setdefault(name, env) != env:
                raise ValueError(f"command {name!r} of env {env!r} is env {out[name]!r}'s "
                                 f"already")
    return out


def default_env() -> str:
    """The short name of the discovered env whose manifest sets ``default`` (``agentgym
    train`` without ``env=``)."""
    found = [cls for cls in discovered() if manifest_of(cls).default]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} envs set EnvManifest.default "
                           f"({', '.join(c.__name__ for c in found)}); exactly one must")
    return found[0].env_short or found[0].env_id


def env_ids() -> list[str]:
    return ENVS.names()


def short_name(env_id: str) -> str:
    """The short name of a registered id (``search``), or the id itself if it has none."""
    return {v: k for k, v in _SHORT.items()}.get(env_id, env_id)


def short_names() -> dict[str, str]:
    return dict(_SHORT)


def env_aliases(name: str) -> set[str]:
    """Every name a dataset row's ``env`` field may use for env ``name``: its full id and
    all its short names (a plugin's class spec among them)."""
    env_id = resolve_env_id(name)
    return {env_id, name, *(s for s, i in _SHORT.items() if i == env_id)}


def discover_envs() -> None:
    """Import every module of this package and register each env class one defines with
    the id its class statement names (``class SearchEnv(AgentEnv,
    env_id="agentgym/Search-v0", short="search")``), with the module's ``MANIFEST``: an env
    added as one file under ``envs/`` needs no edit anywhere else. A second call registers
    nothing twice."""
    import importlib
    import pkgutil

    package = importlib.import_module(__name__.rpartition(".")[0])
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if not isinstance(getattr(module, "MANIFEST", EMPTY), EnvManifest):
            raise TypeError(f"{module.__name__}.MANIFEST is not an envs.manifest.EnvManifest")
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, AgentEnv) and \
                    cls.__module__ == module.__name__ and vars(cls).get("env_id") and \
                    cls.env_id not in ENVS:
                register_env(cls.env_id, f"{cls.__module__}:{cls.__qualname__}",
                             short=cls.env_short)
                _DISCOVERED[cls.env_id] = cls


_DISCOVERED: dict[str, type] = {}  # env id -> class, for the envs of this package
_ENTRY_POINTS: set[tuple[str, str, str]] = set()  # (short, spec, dist) already registered


def register_entry_points() -> list[str]:
    """Register the envs of installed packages' ``agentgym.envs`` entry points (name: the
    short name; value: ``package.module:Class``, imported on first use). A name already
    taken is skipped with a warning, so one bad package cannot break the others. Returns
    the ids registered."""
    import logging

    done = []
    for short, spec, dist in entry_point_envs():
        env_id = f"{dist}/{short}-v0".replace(" ", "-")
        if (short, spec, dist) in _ENTRY_POINTS:
            continue
        if short in _SHORT or env_id in ENVS:
            logging.getLogger(__name__).warning(
                "entry point %s = %s (%s): the name is taken; skipped", short, spec, dist)
            continue
        try:
            register_env(env_id, spec, short=short)
        except ValueError as e:
            logging.getLogger(__name__).warning("entry point %s = %s (%s): %s",
                                                short, spec, dist, e)
            continue
        _ENTRY_POINTS.add((short, spec, dist))
        done.append(env_id)
    return done
