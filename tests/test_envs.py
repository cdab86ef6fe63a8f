"""Environment contract: every registered env passes both checkers; broken envs fail ours."""

from __future__ import annotations

import random
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env

from agentgym import envs
from agentgym.envs import EnvContractError, check_env, make_env
from agentgym.envs.base import AgentEnv, MessagesSpace, TextSpace
from agentgym.envs.registration import register_env, resolve_env_id


#: every registered env that is stepped (env=agent and env=verifiers are played by programs)
STEPPED = [e for e in envs.env_ids() if not envs.env_manifest(e).played_by_program]


@pytest.mark.parametrize("env_id", STEPPED)
def test_registered_env_passes_contract(env_id):
    check_env(make_env(env_id))


@pytest.mark.parametrize("env_id", [c.env_id for c in envs.registration.discovered()])
def test_an_envs_episode_length_is_its_manifests_or_the_configs(env_id):
    """``max_turns`` has one default, the config's (``MAX_TURNS``); an env's own stands in
    its manifest's presets only, and the class built without one takes it."""
    import inspect
    from agentgym.config import RolloutConfig
    from agentgym.envs.manifest import MAX_TURNS, max_turns_of
    cls = envs.env_class(env_id)
    for klass in cls.__mro__:
        if "__init__" in vars(klass) and "max_turns" in inspect.signature(klass).parameters:
            assert inspect.signature(klass).parameters["max_turns"].default is None, klass
    preset = envs.env_manifest(env_id).presets.get("rollout.max_turns")
    assert max_turns_of(cls) == (preset or MAX_TURNS) and RolloutConfig().max_turns == MAX_TURNS
    if not envs.env_manifest(env_id).played_by_program:
        assert make_env(env_id).max_turns == max_turns_of(cls)


def test_the_agent_env_says_it_is_played_by_the_agent_program():
    from agentgym.envs.agent_program import PlayedByProgram
    with pytest.raises(PlayedByProgram, match="played by the agent= program"):
        make_env("agent")


@pytest.mark.parametrize("env_id", STEPPED)
def test_registered_env_passes_gymnasium_checker(env_id):
    env = gymnasium.make(env_id)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gym_check_env(env.unwrapped, skip_render_check=True)
    # Our spaces accept real text, so gymnasium must not flag observations as outside them.
    assert not [w for w in caught if "not within the observation space" in str(w.message)]
    env.close()


def test_gymnasium_make_with_wrappers_steps():
    env = gymnasium.make("agentgym/Search-v0")  # PassiveEnvChecker + OrderEnforcing
    obs, info = env.reset(seed=3)
    assert obs[0]["role"] == "user" and "Question:" in obs[0]["content"]
    obs, reward, terminated, truncated, info = env.step("<answer> nobody </answer>")
    assert terminated and not truncated and reward == 0.0 and obs == []
    env.close()


def test_short_names_and_did_you_mean():
    assert resolve_env_id("search") == "agentgym/Search-v0"
    with pytest.raises(KeyError, match="did you mean 'search'"):
        resolve_env_id("serch")


def test_duplicate_and_malformed_registration_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_env("agentgym/Search-v0", "agentgym.envs.search:SearchEnv")
    with pytest.raises(ValueError, match="namespace/Name-vN"):
        register_env("agentgym/NoVersion", "agentgym.envs.search:SearchEnv")


# --- deliberately broken environments ------------------------------------------------
class GoodToy(gymnasium.Env):
    """A minimal correct text env: answer 'yes' within 3 turns."""

    observation_format = "inline"
    stop_strings = ("</answer>",)

    def __init__(self):
        self.action_space, self.observation_space = TextSpace(), MessagesSpace()
        self._t, self._done = 0, True

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t, self._done = 0, False
        return [{"role": "user", "content": f"say yes #{self.np_random.integers(100)}"}], {}

    def step(self, action):
        if self._done:
            raise RuntimeError("episode ended")
        self._t += 1
        terminated = "yes" in action
        truncated = not terminated and self._t >= 3
        self._done = terminated or truncated
        obs = [] if self._done else [{"role": "tool", "content": "try again"}]
        return obs, float(terminated), terminated, truncated, {}


class NanReward(GoodToy):
    def step(self, action):
        obs, r, te, tr, info = super().step(action)
        return obs, float("nan"), te, tr, info


class IntFlags(GoodToy):
    def step(self, action):
        obs, r, te, tr, info = super().step(action)
        return obs, r, int(te), tr, info


class StepAfterEndAllowed(GoodToy):
    def step(self, action):
        self._done = False
        return super().step(action)


class UnseededReset(GoodToy):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t, self._done = 0, False
        return [{"role": "user", "content": f"say yes #{random.random()}"}], {}


class StringObservation(GoodToy):
    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t, self._done = 0, False
        return "say yes", {}


class BadRole(GoodToy):
    def step(self, action):
        obs, r, te, tr, info = super().step(action)
        return [{"role": "robot", "content": "x"}] if obs else obs, r, te, tr, info


class NeverEnds(GoodToy):
    def step(self, action):
        return [{"role": "tool", "content": "more"}], 0.0, False, False, {}


class CloseTwiceFails(GoodToy):
    closed = False

    def close(self):
        if self.closed:
            raise RuntimeError("already closed")
        self.closed = True


class NoFormat(GoodToy):
    observation_format = "markdown"


def test_good_toy_passes():
    check_env(GoodToy())


@pytest.mark.parametrize("cls, message", [
    (NanReward, "finite"), (IntFlags, "terminated"), (StepAfterEndAllowed, "did not raise"),
    (UnseededReset, "differ"), (StringObservation, "observation of type str"),
    (BadRole, "malformed message"), (NeverEnds, "did not end"),
    (CloseTwiceFails, "second close"), (NoFormat, "observation_format"),
])
def test_checker_catches_broken_env(cls, message):
    with pytest.raises(EnvContractError, match=message):
        check_env(cls())


def test_base_class_guards():
    class Minimal(AgentEnv):
        def _reset(self, row):
            return [{"role": "user", "content": "hi"}], {}

        def _step(self, action, last_turn):
            return [{"role": "tool", "content": "ok"}], 0.0, False, {}

    env = Minimal(max_turns=2)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")
    env.reset(seed=0)
    assert env.step("a")[3] is False
    obs, _, terminated, truncated, info = env.step("b")
    assert truncated and not terminated and obs == [] and info["turn"] == 2
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("c")
    with pytest.raises(ValueError, match="max_turns"):
        Minimal(max_turns=0)


def test_search_format_reward_only_for_well_formed_episodes():
    from agentgym.envs.search import SearchEnv, search_row
    row = search_row("what is the capital of australia", ["Canberra"])
    env = SearchEnv(format_reward=0.1)
    env.reset(seed=0, options={"row": row})
    assert env.step("<answer> Sydney </answer>")[1] == 0.1
    env.reset(seed=0, options={"row": row})
    env.step("no tags")
    assert env.step("<answer> Sydney </answer>")[1] == 0.0
    env.reset(seed=0, options={"row": row})
    _, reward, terminated, _, info = env.step("<answer> the Canberra </answer>")
    assert reward == 1.0 and terminated and info["em"] == 1.0 and info["f1"] == 1.0


def test_search_reports_whether_a_result_held_the_answer(retriever_url):
    """``answer_seen``: 1 once a search result contained a gold answer (whole words,
    normalized), whatever the model answers; 0 for an episode whose searches never did."""
    from agentgym.envs.rewards import contains_answer
    from agentgym.envs.search import SearchEnv, search_row
    assert contains_answer("Doc 1(Title: \"X\") It was the Canberra Times.", ["canberra"])
    assert not contains_answer("Canberras everywhere", ["Canberra"])  # whole words only
    row = search_row("what is the capital of australia", ["Canberra"])
    env = SearchEnv(retriever_url=retriever_url)
    _, info = env.reset(seed=0, options={"row": row})
    assert info["answer_seen"] == 0
    obs, _, _, _, info = env.step("<search> capital of australia canberra </search>")
    assert "canberra" in obs[0]["content"].lower() and info["answer_seen"] == 1
    obs, _, _, _, info = env.step("<search> canberra parliament house </search>")
    assert info["answer_seen"] == 1  # counted once per episode
    *_, info = env.step("<answer> Sydney </answer>")
    assert info["answer_seen"] == 1 and info["em"] == 0.0
    env.reset(seed=0, options={"row": row})
    obs, _, _, _, info = env.step("<search> zzzz qqqq </search>")
    assert "canberra" not in obs[0]["content"].lower() and info["answer_seen"] == 0
    env.close()


def test_search_retrieval_reward_pays_the_first_search_that_finds_the_answer(retriever_url):
    """``search.retrieval_reward``: off by default; on, the first search of an episode whose
    results hold a gold answer earns it on its turn, once (a repeated good search earns
    nothing), on both protocols; the episode's return adds the answer's reward."""
    from agentgym.envs.search import SearchEnv, search_row
    row = search_row("what is the capital of australia", ["Canberra"])
    found, other = "<search> capital of australia canberra </search>", "<search> zzzz qqqq </search>"
    env = SearchEnv(retriever_url=retriever_url)
    env.reset(seed=0, options={"row": row})
    assert env.step(found)[1] == 0.0  # off by default
    env.close()
    env = SearchEnv(retriever_url=retriever_url, retrieval_reward=0.25)
    env.reset(seed=0, options={"row": row})
    assert [env.step(a)[1] for a in (other, found, found, "<answer> Canberra </answer>")] == \
        [0.0, 0.25, 0.0, 1.0]
    env.close()
    env = SearchEnv(retriever_url=retriever_url, retrieval_reward=0.25, protocol="tools")
    env.reset(seed=0, options={"row": row})
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "capital of australia canberra"}}\n</tool_call>'
    assert [env.step(call)[1] for _ in range(2)] == [0.25, 0.0]
    env.close()
    with pytest.raises(ValueError, match="retrieval_reward"):
        SearchEnv(retriever_url=retriever_url, retrieval_reward=-1)
    from agentgym.config import build_config
    with pytest.raises(ValueError, match="search.retrieval_reward"):
        build_config({"search.retrieval_reward": -0.5})


def test_an_env_builds_itself_from_the_config():
    """The env factory: the manifest's ``kwargs`` read the env's own section, the run's
    budgets its preset among them, and the result obeys the contract."""
    from agentgym.config import build_config
    from agentgym.rollout.runtime import env_factory
    cfg = build_config({"env": "geometry", "geometry.tool": True, "geometry.rel_tol": 1e-3})
    assert envs.env_manifest("geometry").kwargs_for(cfg) == {"tool": True, "rel_tol": 1e-3}
    env = env_factory(cfg)()
    assert (env.tool, env.rel_tol, env.max_turns) == (True, 1e-3, 2)  # 2: the env's preset
    assert env.stop_strings == ("</calculator>",)
    check_env(env)
