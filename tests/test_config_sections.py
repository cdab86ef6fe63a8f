"""The typed config and the envs' manifests: ``Config``'s fields for the shipped envs are
exactly the sections their manifests declare (same names, same dataclasses), so the two
cannot drift; the section of an env the config has no field for (a plugin's) lives in
``Config.sections`` and is set, listed, printed and pickled like a field; a manifest's
functions get what their parameters name, and a name they cannot get fails at once."""

from __future__ import annotations

import dataclasses
import pickle
import textwrap
import typing

import pytest

from agentgym import envs
from agentgym.config import Config, all_keys, build_config, set_key, to_dict
from agentgym.core.overrides import parse_overrides
from agentgym.envs.manifest import EnvManifest

MAZE = textwrap.dedent('''
    from dataclasses import dataclass

    from agentgym.envs.base import AgentEnv
    from agentgym.envs.manifest import EnvManifest


    @dataclass
    class MazeConfig:
        size: int = 3

        def __post_init__(self) -> None:
            if self.size < 2:
                raise ValueError(f"maze.size must be >= 2, got {self.size}")


    class MazeEnv(AgentEnv):
        def __init__(self, size: int = 3, max_turns: int = 4) -> None:
            super().__init__(max_turns=max_turns)
            self.size = size

        def _reset(self, row):
            return [{"role": "user", "content": f"How wide is a maze of {self.size}?"}], {}

        def _step(self, action, last_turn):
            return [], float(action.strip() == str(self.size)), True, {}


    MANIFEST = EnvManifest(sections={"maze": MazeConfig}, presets={"rollout.max_turns": 2},
                           kwargs=lambda maze: {"size": maze.size})
''')


@pytest.fixture
def maze(tmp_path, monkeypatch) -> str:
    """``env=mazepkg.maze:MazeEnv``: a plugin env with a config section of its own."""
    (tmp_path / "mazepkg").mkdir()
    (tmp_path / "mazepkg" / "__init__.py").write_text("")
    (tmp_path / "mazepkg" / "maze.py").write_text(MAZE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mazepkg.maze:MazeEnv"


def test_the_typed_fields_are_the_shipped_envs_sections():
    declared = envs.config_sections()  # every env of envs/: the shipped ones
    hints = typing.get_type_hints(Config)
    assert {"search", "retriever", "code", "sandbox"} <= set(declared)
    missing = {name for name, cls in declared.items() if hints.get(name) is not cls}
    assert missing == set(), "add these shipped envs' sections to Config as typed fields"
    # a field of an env's section type that no shipped env declares (the run's own sections
    # are defined in agentgym.config; judge.* is reward=judge's, envs/judge.py; deadlines.*
    # is the watchdog's, agentgym/supervision/watchdog.py, which sits below the config)
    stray = {name for name, t in hints.items() if dataclasses.is_dataclass(t)
             and t.__module__ != "agentgym.config" and name not in ("judge", "deadlines")
             and name not in declared}
    assert stray == set()
    assert Config().sections == {}  # nothing shipped is left to the untyped mapping


def test_a_plugin_envs_section_round_trips_through_overrides(maze):
    cfg = build_config(parse_overrides([f"env={maze}", "maze.size=5"]))
    assert cfg.section("maze") is cfg.sections["maze"] and cfg.sections["maze"].size == 5
    assert cfg.rollout.max_turns == 2  # its manifest's preset
    assert "maze.size" in all_keys(cfg) and to_dict(cfg)["maze"] == {"size": 5}
    assert "sections" not in to_dict(cfg) and "sections" not in all_keys(cfg)
    with pytest.raises(KeyError, match="did you mean 'maze.size'"):
        set_key(cfg, "maze.sise", 4)
    with pytest.raises(ValueError, match="maze.size='big'"):
        set_key(cfg, "maze.size", "big")
    with pytest.raises(ValueError, match="maze.size must be >= 2"):
        set_key(cfg, "maze.size", 1)
    set_key(cfg, "maze.size", 7)
    assert cfg.sections["maze"].size == 7
    printed = to_dict(cfg)["maze"]
    again = build_config({"env": maze, **{f"maze.{k}": v for k, v in printed.items()}})
    assert to_dict(again) == to_dict(cfg)
    assert pickle.loads(pickle.dumps(cfg)).sections["maze"].size == 7  # Ray, processes
    from agentgym.rollout.runtime import env_factory
    env = env_factory(cfg)()  # the manifest's kwargs got the section by its name
    assert (env.size, env.max_turns) == (7, 2)
    with pytest.raises(KeyError, match="unknown config key 'maze.size'"):
        build_config({"env": "search", "maze.size": 5})  # another env's run has no maze


def test_a_section_name_is_one_envs(tmp_path, monkeypatch):
    clash = MAZE.replace('sections={"maze"', 'sections={"search"').replace(
        'lambda maze: {"size": maze.size}', "lambda search: {}")
    (tmp_path / "clash.py").write_text(clash)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="section 'search' is already SearchConfig's"):
        build_config({"env": "clash:MazeEnv"})


def test_a_manifest_function_gets_what_it_names():
    @dataclasses.dataclass
    class Box:
        width: int = 2

    seen = []
    manifest = EnvManifest(
        sections={"box": Box}, reads={"turns": "rollout.max_turns", "cells": "sft.max_cells"},
        kwargs=lambda box, turns: {"area": box.width * turns},
        filter_rows=lambda rows, limit, cells: (seen.append(cells) or rows[:cells], len(rows)))
    cfg = Config()
    cfg.sections["box"] = Box(width=3)
    assert manifest.kwargs_for(cfg) == {"area": 3 * cfg.rollout.max_turns}
    assert manifest.filter_rows_for(cfg, list(range(10))) == (list(range(3)), 10)
    assert seen == [cfg.sft.max_cells] and manifest.row_filter_for(cfg) is None
    assert manifest.demo_refusal(cfg) == "it has no demonstration builder"
    with pytest.raises(ValueError, match="takes 'cfg', which is neither a section"):
        EnvManifest(sections={"box": Box}, kwargs=lambda cfg: {})


def test_the_search_manifest_reads_named_keys_not_the_config():
    """The search env's demonstrations and row filter follow ``sft.max_searches``,
    ``search.protocol`` and ``data.answerable_only``: named in its manifest, set as ever."""
    search = envs.env_manifest("search")
    cfg = build_config({"env": "search", "sft.max_searches": 3})
    assert search.demo_options_for(cfg) == {"max_searches": 3}
    assert search.row_filter_for(cfg) is not None
    assert search.row_filter_for(build_config({"data.answerable_only": False})) is None
    refused = build_config({"env": "search", "search.protocol": "tools"})
    assert search.demo_refusal(refused) == \
        "its demonstration builder needs search.protocol=tags, not tools"
    assert search.tool_calls_label == "searches" and envs.default_env() == "search"


def test_an_env_class_that_still_declares_what_the_manifest_holds_is_refused():
    from agentgym.envs.base import AgentEnv
    with pytest.raises(TypeError, match="sets config_kwargs, presets: .* MANIFEST"):
        class Old(AgentEnv):  # noqa: F841 - the class statement itself fails
            presets = {"rollout.max_turns": 2}

            @classmethod
            def config_kwargs(cls, cfg):
                return {}
