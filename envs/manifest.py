"""What the trainer asks of an env, declared once per env: :class:`EnvManifest`.

An env module holds two things: its env class (the Gymnasium-sized contract of
:mod:`agentgym.envs.base`: reset, step, the tool protocol) and one module-level
``MANIFEST = EnvManifest(...)``: its config sections, the keys it sets when chosen, its
datasets, its row filter, its demonstrations, what its observations come from, its
episode metrics and the constructor arguments (services included) it takes from the
config. The registry finds the manifest by the env's class
(:func:`agentgym.envs.registration.env_manifest`; :func:`manifest_of`).

The manifest's functions never see the whole run's config. Each names what it reads by
its parameters: a parameter named after one of the env's :attr:`~EnvManifest.sections`
receives that section (``search``: the ``search.*`` dataclass); one named in
:attr:`~EnvManifest.reads` receives the value of the run key it maps to
(``reads={"curriculum": "data.curriculum"}``). Callers hand the run's config to the
manifest's ``*_for`` methods, which pick those values out (:meth:`EnvManifest.call`). A
parameter that is neither is an error when the manifest is made, not when a run uses it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: the manifest's functions and how many leading arguments each takes from its caller
#: (``filter_rows(rows, limit, ...)``); the rest come from the config by name
_FUNCTIONS = {"kwargs": 0, "row_filter": 0, "filter_rows": 2, "demo_options": 0, "sources": 0,
              "check": 0, "adapt_row": 2}


@dataclass(frozen=True)
class EnvManifest:
    """Everything the trainer asks of one env, as plain values and functions.

    Attributes:
        sections: the config sections the env owns, ``{name: dataclass}``: ``cfg.<name>``
            (or ``cfg.sections[name]`` for an env the config has no field for), set on the
            command line as ``<name>.<key>=value``.
        reads: run keys outside its sections that its functions read, ``{parameter name:
            dotted key}`` (``{"max_searches": "sft.max_searches"}``).
        presets: keys the run's config takes when this env is chosen, under the command's
            own and the user's (``{"rollout.max_turns": 2}``).
        datasets: ``data=NAME``'s datasets: a file under the data folder (``data/``), or a
            function that makes the rows, its parameters (if any) sections or keys of
            :attr:`reads` like the other functions'.
        default: the env of ``agentgym train`` without ``env=`` (one env sets it).
        plays_any_rows: rows whose ``env`` names another env are still this env's to play.
        played_by_program: the rows are played by the user's program (``agent=``,
            :mod:`agentgym.serving.agents`), not stepped here.
        program: for an env played by a program of its own (``env=verifiers``): a
            ``module:Class`` built with the run's config, whose ``async play(row,
            base_url)`` plays one episode against the endpoint and returns its reward,
            and ``close()`` ends what it started; ``agent=`` is then not needed.
        check: ``(...) -> str``: ``agentgym check-env``'s check of an env not stepped here
            (it raises what it finds wrong); what it checked, in words.
        kwargs: ``(...) -> dict``: constructor arguments beyond ``max_turns``; starts or
            connects what the env needs (a retriever, a sandbox, a server) once per
            process. Called once per env factory, not per episode.
        row_filter: ``(...) -> str | None``: what :attr:`filter_rows` keeps of the training
            and held-out rows, in words ("have a gold answer in the corpus"); None: the rows
            are used as they are.
        filter_rows: ``(rows, limit, ...) -> (the first limit rows kept (0: all), how many
            it keeps)``; called only when :attr:`row_filter` names a filter. Raises
            ValueError, saying what to change, when it keeps none.
        demonstrate: ``(row, env, **demo_options) -> demonstration | None``: plays one
            training row through a live env for the cold start's SFT
            (:mod:`agentgym.data.demo_builders`); None: RL starts from the model as it is.
        demo_options: ``(...) -> dict``: the keyword arguments :attr:`demonstrate` takes.
        demo_requires: run keys and the values :attr:`demonstrate` needs
            (``{"search.protocol": "tags"}``: the builder writes the text tags).
        sources: ``(...) -> JSON-able data``: what the observations come from (a corpus, a
            sandbox's settings); part of the cache key of the cold start's work.
        episode_metrics: info keys of an episode's last step that rollouts average into
            their metrics (a key missing from an episode counts 0; an env may report more
            for one episode, :attr:`agentgym.envs.base.AgentEnv.episode_metrics`).
        tool_calls_label: what the env's tool calls are called in reports ("searches").
        adapt_row: ``(row, where) -> row``: a row in the format the env's tasks are
            published in (SWE-bench's), with verl's fields added, so a user's rows load
            with ``data=`` as they are; a row already in verl's format comes back as it
            is. Raises ValueError naming the row (``where``) and what is wrong.
        commands: ``{name: {subcommand: function}}``: ``agentgym NAME SUBCOMMAND
            key=value ...`` commands the env brings (``agentgym swe validate``; the CLI
            names no env, it finds them here). The CLI builds the run's config from the
            arguments; a function whose first parameter is ``rows`` gets the rows of
            ``data=`` (loaded as :attr:`adapt_row` adapts them), the rest by name as the
            other functions'. It yields its report's lines as they come (the CLI prints
            them) and returns its exit status.
    """

    sections: Mapping[str, type] = field(default_factory=dict)
    reads: Mapping[str, str] = field(default_factory=dict)
    presets: Mapping[str, Any] = field(default_factory=dict)
    datasets: Mapping[str, Any] = field(default_factory=dict)
    default: bool = False
    plays_any_rows: bool = False
    played_by_program: bool = False
    program: str = ""
    check: Callable[..., str] | None = None
    kwargs: Callable[..., dict] | None = None
    row_filter: Callable[..., str | None] | None = None
    filter_rows: Callable[..., tuple[list[dict], int]] | None = None
    demonstrate: Callable[..., Any] | None = None
    demo_options: Callable[..., dict] | None = None
    demo_requires: Mapping[str, Any] = field(default_factory=dict)
    sources: Callable[..., Any] | None = None
    episode_metrics: tuple[str, ...] = ()
    tool_calls_label: str = "tool calls"
    adapt_row: Callable[..., dict] | None = None
    commands: Mapping[str, Mapping[str, Callable[..., Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, section in self.sections.items():
            if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
                raise TypeError(f"sections[{name!r}] is {section!r}, not a dataclass")
        if self.program and not self.played_by_program:
            raise ValueError(f"program={self.program!r} plays the rows: set "
                             f"played_by_program=True too")
        if clash := set(self.reads) & set(self.sections):
            raise ValueError(f"reads names {sorted(clash)} that are sections already")
        hooks = [(hook, getattr(self, hook), leading) for hook, leading in _FUNCTIONS.items()]
        hooks += [(f"datasets[{name!r}]", made, 0) for name, made in self.datasets.items()
                  if callable(made)]
        hooks += [(f"commands[{name!r}][{sub!r}]", fn, int(takes_rows(fn)))
                  for name, subs in self.commands.items() for sub, fn in subs.items()]
        for hook, fn, leading in hooks:
            if fn is None:
                continue
            for p in list(inspect.signature(fn).parameters.values())[leading:]:
                if p.name not in self.sections and p.name not in self.reads and \
                        p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    raise ValueError(
                        f"{hook}={getattr(fn, '__name__', fn)!r} takes {p.name!r}, which is "
                        f"neither a section ({', '.join(self.sections) or 'none'}) nor in "
                        f"reads ({', '.join(self.reads) or 'none'})")

    # -- what callers ask, each with the run's config ----------------------------------
    def call(self, fn: Callable, cfg: Any, *args: Any) -> Any:
        """``fn(*args, ...)``, each further parameter filled from the run's config ``cfg``:
        a section by its name, a name of :attr:`reads` by its key's value."""
        values = {}
        for name in list(inspect.signature(fn).parameters)[len(args):]:
            if name in self.sections:
                values[name] = config_value(cfg, name)
            elif name in self.reads:
                values[name] = config_value(cfg, self.reads[name])
        return fn(*args, **values)

    def kwargs_for(self, cfg: Any) -> dict[str, Any]:
        """The env's constructor arguments under ``cfg`` (beyond ``max_turns``)."""
        return self.call(self.kwargs, cfg) if self.kwargs else {}

    def row_filter_for(self, cfg: Any) -> str | None:
        """What the row filter keeps under ``cfg``, in words; None: no filter applies."""
        return self.call(self.row_filter, cfg) if self.row_filter else None

    def filter_rows_for(self, cfg: Any, rows: list[dict],
                        limit: int = 0) -> tuple[list[dict], int]:
        """``(the first limit rows the filter keeps (0: all), how many it keeps)``."""
        if self.filter_rows is None:
            return (rows[:limit] if limit else rows), len(rows)
        return self.call(self.filter_rows, cfg, rows, limit)

    def demo_options_for(self, cfg: Any) -> dict[str, Any]:
        """The keyword arguments :attr:`demonstrate` takes under ``cfg``."""
        return self.call(self.demo_options, cfg) if self.demo_options else {}

    def demo_refusal(self, cfg: Any) -> str | None:
        """Why there are no demonstrations under ``cfg`` (None: there are)."""
        if self.demonstrate is None:
            return "it has no demonstration builder"
        for key, want in self.demo_requires.items():
            if (value := config_value(cfg, key)) != want:
                return f"its demonstration builder needs {key}={want}, not {value}"
        return None

    def sources_for(self, cfg: Any) -> Any:
        """What the observations come from under ``cfg`` (JSON-able)."""
        return self.call(self.sources, cfg) if self.sources else {}


def takes_rows(fn: Callable) -> bool:
    """Whether command ``fn`` (:attr:`EnvManifest.commands`) takes the rows of ``data=``."""
    return next(iter(inspect.signature(fn).parameters), None) == "rows"


#: the manifest of an env whose module declares none: nothing beyond the env class
EMPTY = EnvManifest()


def config_value(cfg: Any, key: str) -> Any:
    """The value of run key ``key`` in the config ``cfg``: a section by its name
    (``search``; :meth:`agentgym.config.Config.section` finds a plugin's too) or a dotted
    key (``data.curriculum``)."""
    head, *rest = key.split(".")
    node = cfg.section(head)
    for part in rest:
        node = getattr(node, part)
    return node


def manifest_of(cls: type) -> EnvManifest:
    """The manifest of env class ``cls``: the ``MANIFEST`` of its module, else of the
    nearest base class's module (a plugin that extends a shipped env keeps its manifest),
    else :data:`EMPTY`."""
    for klass in cls.__mro__:
        found = getattr(sys.modules.get(klass.__module__), "MANIFEST", None)
        if isinstance(found, EnvManifest):
            return found
    return EMPTY


#: actions per episode where neither the env's manifest (``presets["rollout.max_turns"]``)
#: nor the run says otherwise: ``RolloutConfig.max_turns``'s default
MAX_TURNS = 4


def max_turns_of(cls: type) -> int:
    """An env class's own episode length: its manifest's ``rollout.max_turns`` preset, else
    :data:`MAX_TURNS` (what a run passes instead is ``rollout.max_turns``)."""
    return int(manifest_of(cls).presets.get("rollout.max_turns", MAX_TURNS))
