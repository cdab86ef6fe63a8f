"""The repository's top-level folders as subpackages of ``agentgym`` in a checkout.

``envs/``, ``tools/``, ``trainers/`` and ``retriever_server/`` stand beside ``agentgym/``
in the repository but are the subpackages ``agentgym.envs`` … (:data:`SUBPACKAGES`).
Installed, the wheel puts them under ``agentgym/`` (pyproject's ``package-dir``) and
Python finds them there; in a checkout, :class:`_Folders` finds them beside it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

#: the subpackages of agentgym whose folders stand at the repository's top level
SUBPACKAGES = ("envs", "tools", "trainers", "retriever_server")
_HERE = Path(__file__).resolve().parent


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


def install() -> None:
    """Put :class:`_Folders` on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Folders) for f in sys.meta_path):
        sys.meta_path.insert(0, _Folders())
