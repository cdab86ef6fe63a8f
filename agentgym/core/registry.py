"""One small generic registry for the extension points (envs, engines, algorithms).

Entries are either objects or lazy ``"package.module:attr"`` strings, so heavy
dependencies load only when an entry is used. Duplicate names are rejected; an unknown
name fails with the valid choices and a "did you mean" suggestion.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Generic, Iterator, TypeVar

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_entry_point(spec: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"entry point {spec!r} must look like 'package.module:attr'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Name → object (or lazy entry point) map with loud failures.

    Args:
        kind: what is registered, used in error messages ("environment", "engine").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}
        self._extras: dict[str, dict[str, Any]] = {}

    def register(self, name: str, entry: T | str | None = None, **extras: Any) -> Any:
        """Register ``entry`` under ``name``; usable as a decorator when entry is None."""
        if entry is None:
            def deco(obj: T) -> T:
                self.register(name, obj, **extras)
                return obj
            return deco
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered; "
                             f"pick another name or bump its version")
        self._entries[name] = entry
        self._extras[name] = dict(extras)
        return entry

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; "
                           f"valid: {', '.join(self.names()) or '(none registered)'}")
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = load_entry_point(entry)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def extras(self, name: str) -> dict[str, Any]:
        self.get(name)  # same error for unknown names
        return self._extras[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)



def check_choices(section: str, obj: Any, choices: dict[str, tuple]) -> None:
    """Raise ValueError naming ``section.key``, its value and the valid ones (with a "did
    you mean") when a field of ``obj`` is not among its ``choices``."""
    for key, valid in choices.items():
        value = getattr(obj, key)
        if value not in valid:
            names = [repr(v) if v == "" else str(v) for v in valid]
            raise ValueError(f"{section}.{key}={value!r}{did_you_mean(str(value), names)}; "
                             f"valid: {', '.join(names)}")


def env_names(env) -> list[str]:
    """The envs of ``env`` (the ``env`` key): one name, or several (``[search,code]``,
    ``search,code``: a mixed run)."""
    items = env if isinstance(env, list) else str(env).strip().strip("[]").split(",")
    return [n for n in (str(x).strip().strip("'\"") for x in items) if n]
