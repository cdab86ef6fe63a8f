"""The command line's ``key=value`` words as values: :func:`parse_overrides` reads them as
YAML, :func:`coerce` checks one against its config field's type."""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import yaml


#: YAML 1.1 reads these as booleans; here they stay words, so a text key keeps them
#: (``trainer.cold_start=off``) and a boolean key still takes them (``engine.prefix_cache=off``).
_BOOL_WORDS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans only (``true``/``false``): the words of
    :data:`_BOOL_WORDS` stay words, on the command line and in a recipe alike."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def load_yaml(text: str) -> Any:
    """``text`` as YAML, ``yes/no/on/off`` kept as words (:class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["a.b=1", "c=[x, y]"]`` → ``{"a.b": 1, "c": ["x", "y"]}`` (YAML-parsed values;
    ``yes/no/on/off`` stay words, see :data:`_BOOL_WORDS`)."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {arg!r}")
        try:
            out[key.strip()] = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def coerce(key: str, raw: Any, hint: Any) -> Any:
    """Check/convert a parsed value to the annotated type; error names key and value."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return coerce(key, raw, [a for a in typing.get_args(hint) if a is not type(None)][0])
    if origin is list:
        items = raw if isinstance(raw, list) else [raw]
        (item_t,) = typing.get_args(hint) or (str,)
        return [coerce(key, x, item_t) for x in items]
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[raw.lower()]
    elif hint is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
    elif hint is float:
        if isinstance(raw, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(raw)
            except ValueError:
                pass
        elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif hint is str:  # a list: names, one per env of a mixed run (data=[train,arith])
        return ",".join(map(str, raw)) if isinstance(raw, list) else "" if raw is None else str(raw)
    else:
        return raw
    raise ValueError(f"{key}={raw!r} is not a valid {hint.__name__}")
