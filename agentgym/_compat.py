"""Old import paths, kept for one release with a DeprecationWarning.

The package was laid out by stage in one step (docs/ARCHITECTURE.md): ``agentgym.types``
became ``agentgym.core.types``, ``agentgym.manager`` ``agentgym.rollout.manager``, and so
on (:data:`MOVED`). A user's env or script that imports an old path gets the new module
itself (the same object, so ``isinstance`` and monkeypatching still hold) and a warning
naming the new path. ``agentgym.models`` and ``agentgym.data`` are packages now; the names
their old modules held are served from ``agentgym.models.zoo`` / ``agentgym.data.rows``
the same way (:func:`deprecated_attributes`).

One installed namespace (issue 38): the repository keeps its top-level folders ``envs/``,
``tools/``, ``trainers/`` and ``retriever_server/``, but they are the subpackages
``agentgym.envs`` … (:data:`SUBPACKAGES`): the wheel puts them under ``agentgym/``, and
in a checkout :class:`_Folders` finds them beside it. Their old top-level names import,
with a warning, as the same modules (:data:`MOVED`, :func:`serve_old_name`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from pathlib import Path

#: old module -> new module (a prefix maps its submodules too: agentgym.engines.hf)
MOVED = {
    "agentgym.types": "agentgym.core.types",
    "agentgym.registry": "agentgym.core.registry",
    "agentgym.paths": "agentgym.core.paths",
    "agentgym.server_process": "agentgym.core.server_process",
    "agentgym.device": "agentgym.core.device",
    "agentgym.memory": "agentgym.core.memory",
    "agentgym.tiny_models": "agentgym.models.tiny",
    "agentgym.vision": "agentgym.models.vision",
    "agentgym.manager": "agentgym.rollout.manager",
    "agentgym.chat": "agentgym.rollout.chat",
    "agentgym.runtime": "agentgym.rollout.runtime",
    "agentgym.engines": "agentgym.rollout.engines",
    "agentgym.demos": "agentgym.data.demos",
    "agentgym.demo_builders": "agentgym.data.demo_builders",
    "agentgym.answerable": "agentgym.envs.answerable",
    "agentgym.data.answerable": "agentgym.envs.answerable",
    "agentgym.data.arith": "agentgym.envs.arith",
    "agentgym.trainers.local_rollout": "agentgym.trainers.workers",
    "agentgym.trainers.async_rollout": "agentgym.trainers.async_steps",
    "agentgym.trainers.sampling": "agentgym.trainers.steps",
    "agentgym.trainers.samples": "agentgym.trainers.sample_log",
    "agentgym.serve": "agentgym.serving.serve",
    "agentgym.metrics": "agentgym.reporting.metrics",
    "agentgym.evaluation": "agentgym.reporting.evaluation",
    "agentgym.inspector": "agentgym.reporting.inspector",
    "agentgym.stats": "agentgym.reporting.stats",
    "envs": "agentgym.envs",
    "tools": "agentgym.tools",
    "trainers": "agentgym.trainers",
    "retriever_server": "agentgym.retriever_server",
}
#: the subpackages of agentgym whose folders stand at the repository's top level
SUBPACKAGES = ("envs", "tools", "trainers", "retriever_server")
_HERE = Path(__file__).resolve().parent


def new_name(old: str) -> str | None:
    """The module that replaced ``old`` (or ``old``'s package), or None."""
    for prefix, target in MOVED.items():
        if old == prefix or old.startswith(prefix + "."):
            return target + old[len(prefix):]
    return None


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path works until the next release",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module itself (importlib keeps the module's own
    ``__name__`` and ``__spec__``, and files it under the old name as well)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass  # already executed under its new name

    def get_code(self, fullname):  # ``python -m`` an old name runs the new module's code
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _Finder(importlib.abc.MetaPathFinder):
    """Resolves the old module names of :data:`MOVED` to the new modules."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


class _Folders(importlib.abc.MetaPathFinder):
    """In a checkout, ``agentgym.envs`` (…) is the folder ``envs/`` beside ``agentgym/``;
    installed, it is ``agentgym/envs/`` and this finder finds nothing."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, name = fullname.partition(".")
        if head != "agentgym" or name not in SUBPACKAGES or (_HERE / name).is_dir():
            return None
        init = _HERE.parent / name / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(init.parent)])


def serve_old_name(name: str) -> None:
    """Called first by each of :data:`SUBPACKAGES`' ``__init__``: run under its old
    top-level name (``import envs`` from a checkout, before ``agentgym`` was imported), the
    package files the new module under that name, so the rest of the file only re-imports
    what the new one holds and ``import envs`` returns ``agentgym.envs`` itself."""
    if name in SUBPACKAGES:
        _warn(name, f"agentgym.{name}")
        sys.modules[name] = importlib.import_module(f"agentgym.{name}")


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if not any(isinstance(f, _Folders) for f in sys.meta_path):
        sys.meta_path.insert(1, _Folders())


def moved_attribute(package: str, name: str, module: str, new: str | None = None):
    """``module.new`` (``new`` defaults to ``name``), served as ``package.name`` with a
    DeprecationWarning pointing at the caller of the module ``__getattr__`` that calls it."""
    new = new or name
    warnings.warn(f"{package}.{name} moved to {module}.{new}; the old path works until the "
                  f"next release", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(module), new)


def moved_names(package: str, moved: dict[str, str]):
    """A module ``__getattr__`` for ``package`` serving each old name of ``moved`` (old name
    -> ``"module"``, or ``"module:new_name"`` for a rename) with a DeprecationWarning."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, new = moved[name].partition(":")
        return moved_attribute(package, name, module, new or None)

    return __getattr__


def deprecated_attributes(package: str, module: str, names: tuple[str, ...] = ()):
    """A module ``__getattr__`` for ``package`` that serves ``module``'s names (only
    ``names``, when given) with a DeprecationWarning: the names the package's old module
    held, or names that moved out of a module."""

    def __getattr__(name: str):
        if name.startswith("__") or (names and name not in names) or \
                not hasattr(importlib.import_module(module), name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return moved_attribute(package, name, module)

    return __getattr__
