"""reasoning-gym's tasks as an env, unchanged: ``agentgym/ReasoningGym-v0``
(``env=reasoning_gym``).

reasoning-gym (``pip install -e '.[reasoning-gym]'``) generates about a hundred task
families from a seed (``reasoning_gym.create_dataset(name, seed=, size=, **settings)``),
each entry a question, an answer and metadata, and scores an answer with the task's own
``dataset.score_answer(answer, entry)``. This env plays them as they are:

    agentgym train env=reasoning_gym reasoning_gym.tasks=leg_counting
    agentgym train env=reasoning_gym reasoning_gym.tasks=[leg_counting,spell_backward] \\
        reasoning_gym.weights=[3,1] reasoning_gym.config='{spell_backward: {max_word_len: 5}}'

* **Rows** (``data=train``, ``data=test``; :func:`task_rows`): ``reasoning_gym.size`` rows
  from the generators at ``reasoning_gym.seed``, shared among the tasks by
  ``reasoning_gym.weights``, interleaved in those proportions; the held-out rows
  (``trainer.eval_data=test``) come from ``reasoning_gym.eval_seed``. reasoning-gym seeds
  entry ``i`` of a dataset with ``seed + i``, so the two index ranges must not overlap
  (checked), and a training question equal to a held-out one is skipped (small settings
  repeat questions); the held-out set keeps each question once.
* **Settings**: ``reasoning_gym.config`` is the generator's config (its dataclass's fields:
  ``{min_animals: 2, max_animals: 4}``), or ``{task: {...}}`` per task of a mix.
* **Difficulty**: ``reasoning_gym.levels=K`` makes rows at the first ``K`` levels of the
  task's own curriculum (``reasoning_gym.create_curriculum(task)``, every attribute at
  level ``k - 1``), each row's ``extra_info.level`` set, so ``data.curriculum=solve_rate``
  starts at level 1 and moves up as the policy solves it. A task without a curriculum
  plays at its config's settings as level 1; a level its curriculum cannot make (its own
  config check fails) ends the levels there, with a warning.
* **Protocol**: the prompt is reasoning-gym's own system prompt (``reasoning_gym.prompt``:
  one of its ``SYSTEM_PROMPTS``, ``default`` unless set) and the question as the user turn;
  the answer is the text of the last ``<answer>…</answer>`` (reasoning-gym's
  ``extract_answer``). ``reasoning_gym.tool=code`` adds the sandboxed interpreter of the
  code env: ``<code>```python …```</code>`` runs and answers ``<interpreter>…</interpreter>``
  inline (the code env's sandbox, ``sandbox.*`` and ``code.obs_bytes``), until the answer
  or ``rollout.max_turns``; without it the first reply is the answer.
* **Reward**: the task's ``score_answer`` (reasoning-gym's partial credit included;
  ``reasoning_gym.reward=solved``: 1.0 only for a score of 1.0, else 0.0), from
  the entry regenerated from the row (task, settings, level, seed, index), so a row in a
  file scores as it did when made; ``info["em"]`` is 1.0 when the score is 1.0 (the solve
  rate the curriculum and the held-out tables count), ``info["score"]`` the score.
* **Cold start** (:func:`rg_demo`): a demonstration answers ``<answer>{answer}</answer>``
  with the entry's answer; with ``tool=code``, an entry whose metadata holds its arithmetic
  ``expression`` is demonstrated by a cell printing it, then that value as the answer.
  Either is kept only when the task scores it 1.0 (tasks whose entries have no single
  answer give none).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import asdict, dataclass, field

from agentgym.core.registry import did_you_mean
from agentgym.envs.code import _CODE, _FENCE, _NOT_PROSE, NO_CODE  # its cell protocol
from agentgym.envs.code import CodeConfig, CodeEnv, code_kwargs
from agentgym.envs.manifest import EnvManifest
from agentgym.tools.sandbox import SandboxConfig
from agentgym.tools.errors import MissingExtra

logger = logging.getLogger(__name__)

INSTALL = "pip install -e '.[reasoning-gym]' in the checkout (or reasoning-gym==0.1.25)"
CODE_PROMPT = ("\nYou can run Python to help you: write it as <code>\n```python\ncode\n```\n"
               "</code> and its output comes back as <interpreter>output</interpreter>.")
INVALID_ACTION = ("\nMy previous action is invalid. To run code I should put it between <code> "
                  "and </code>; to answer I should write <answer>answer</answer>. "
                  "Let me try again.\n")
PROTOCOLS = ("", "code")
REWARDS = ("score", "solved")


def rg():
    """The ``reasoning_gym`` package, or an ImportError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingExtra(f"env=reasoning_gym needs the reasoning-gym package: {INSTALL}") \
            from e
    return reasoning_gym


@dataclass
class ReasoningGymConfig:
    """``reasoning_gym.*``: which tasks, at which settings, from which seeds."""

    tasks: str = "leg_counting"  # reasoning-gym task names: one, or a list for a mix
    weights: list[float] = field(default_factory=list)  # a mix's shares in task order ([]: equal)
    config: dict = field(default_factory=dict)  # generator settings, or {task: {...}} per task
    size: int = 1000  # training rows (data=train), all tasks together
    seed: int = 0  # the training rows' seed
    eval_size: int = 200  # held-out rows (trainer.eval_data=test)
    eval_seed: int = 1_000_000  # the held-out rows' seed: its index range must not meet seed's
    levels: int = 0  # rows at the first K levels of the task's curriculum (0: config as given)
    prompt: str = "default"  # reasoning-gym's SYSTEM_PROMPTS name
    tool: str = ""  # "" (the reply is the answer) | code (the sandboxed interpreter first)
    reward: str = "score"  # score (the task's score_answer, partial credit kept) | solved (1 or 0)

    def __post_init__(self) -> None:
        names = self.task_names()
        if not names:
            raise ValueError("reasoning_gym.tasks is empty; name a reasoning-gym task, e.g. "
                             "reasoning_gym.tasks=leg_counting")
        if len(set(names)) != len(names):
            raise ValueError(f"reasoning_gym.tasks={self.tasks!r} names a task twice")
        if self.weights and len(self.weights) != len(names):
            raise ValueError(f"reasoning_gym.weights={self.weights} gives {len(self.weights)} "
                             f"weights for {len(names)} task(s) ({', '.join(names)})")
        if any(w <= 0 for w in self.weights):
            raise ValueError(f"reasoning_gym.weights={self.weights}: weights must be > 0")
        if not isinstance(self.config, dict):
            raise ValueError(f"reasoning_gym.config={self.config!r} must be a mapping of "
                             f"settings, e.g. {{min_animals: 2}} or {{task: {{...}}}}")
        for name in ("size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"reasoning_gym.{name} must be >= 1, got {getattr(self, name)}")
        if self.levels < 0:
            raise ValueError(f"reasoning_gym.levels must be >= 0, got {self.levels}")
        if self.tool not in PROTOCOLS:
            raise ValueError(f"reasoning_gym.tool={self.tool!r}; valid: '' (none), code")
        if self.reward not in REWARDS:
            raise ValueError(f"reasoning_gym.reward={self.reward!r}; valid: {', '.join(REWARDS)}")
        if self.seed < self.eval_seed + self.eval_size and \
                self.eval_seed < self.seed + self.size:
            raise ValueError(
                f"reasoning_gym.seed={self.seed} (size {self.size}) and eval_seed="
                f"{self.eval_seed} (eval_size {self.eval_size}) overlap: reasoning-gym seeds "
                f"entry i with seed + i, so held-out rows would repeat training ones; give "
                f"an eval_seed >= {self.seed + self.size} or <= {self.seed - self.eval_size}")

    def task_names(self) -> list[str]:
        return [t.strip() for t in self.tasks.split(",") if t.strip()]

    def settings(self, task: str) -> dict:
        """The generator settings the user gave for ``task``."""
        names = self.task_names()
        if self.config and all(k in names for k in self.config):
            return dict(self.config.get(task) or {})
        if len(names) > 1 and self.config:
            raise ValueError(f"reasoning_gym.config={self.config!r} mixes settings and task "
                             f"names; with several tasks give {{task: {{setting: value}}}} "
                             f"(tasks: {', '.join(names)})")
        return dict(self.config)


# -- rows ------------------------------------------------------------------------------
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=256)
def _dataset(task: str, level: int, settings: str, seed: int, size: int):
    """reasoning-gym's dataset for one task at one level (0: the settings as given)."""
    gym = rg()
    kwargs = {**json.loads(settings), "seed": seed, "size": size}
    if level:
        curriculum = gym.factory.create_curriculum(task)
        curriculum.set_global_level(level - 1)
        cls, _ = gym.factory.DATASETS[task]
        return cls(config=curriculum.generate_configuration(kwargs))
    return gym.create_dataset(task, **kwargs)


def dataset_of(task: str, level: int, settings: dict, seed: int, size: int):
    with _LOCK:  # one build per key, whichever thread asks first
        return _dataset(task, level, json.dumps(settings, sort_keys=True), seed, size)


def check_task(task: str) -> None:
    names = sorted(rg().factory.DATASETS)
    if task not in names:
        raise ValueError(f"reasoning_gym.tasks: unknown task {task!r}{did_you_mean(task, names)}"
                         f"; valid: {', '.join(n for n in names if n != 'composite')}")


def task_levels(task: str, levels: int, settings: dict, seed: int) -> list[int]:
    """The levels rows of ``task`` are made at: ``[0]`` (its settings as given) without
    ``levels`` or a curriculum; else 1..K, K at most ``levels`` and the curriculum's
    deepest, ending before the first level its own config check refuses."""
    gym = rg()
    if not levels:
        return [0]
    if not gym.factory.has_curriculum(task):
        logger.warning("reasoning_gym.levels=%d: task %s has no curriculum in reasoning-gym; "
                       "its rows are level 1 at its settings", levels, task)
        return [0]
    curriculum = gym.factory.create_curriculum(task)
    deepest = max(len(a.levels) for a in curriculum.attributes.values())
    out = []
    for level in range(1, min(levels, deepest) + 1):
        try:
            dataset_of(task, level, settings, seed, 1)[0]
        except Exception as e:  # noqa: BLE001 - reasoning-gym's own check, reported
            logger.warning("reasoning_gym.levels=%d: task %s's curriculum cannot make level "
                           "%d (%s: %s); its rows stop at level %d", levels, task, level,
                           type(e).__name__, e, level - 1)
            break
        out.append(level)
    if not out:
        raise ValueError(f"reasoning_gym.levels={levels}: task {task}'s curriculum cannot "
                         f"make its first level; use reasoning_gym.levels=0")
    return out


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders), each at least 1."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [max(1, int(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: int(exact[i]) - exact[i])
    for i in order[:max(0, total - sum(counts))]:
        counts[i] += 1
    return counts


def _proportional(groups: list[list[dict]]) -> list[dict]:
    """The groups' rows interleaved in proportion to their sizes, each group in order:
    the first ``k`` rows hold every group's share of ``k``, so ``limit=`` keeps the mix."""
    keyed = [((i + 0.5) / len(g), j, row) for j, g in enumerate(groups) for i, row in enumerate(g)]
    return [row for *_, row in sorted(keyed, key=lambda x: x[:2])]


def make_row(task: str, level: int, settings: dict, seed: int, size: int, index: int,
             entry: dict, split: str, prompt: str, tool: str) -> dict:
    """A verl-format row for one reasoning-gym entry; ``extra_info`` names everything the
    env needs to regenerate the entry and score it."""
    system = rg().utils.SYSTEM_PROMPTS[prompt] + (CODE_PROMPT if tool == "code" else "")
    answer = entry.get("answer")
    return {"data_source": f"reasoning_gym/{task}",
            "prompt": [{"role": "system", "content": system},
                       {"role": "user", "content": entry["question"]}],
            "ability": "reasoning",
            "reward_model": {"style": "rule",
                             "ground_truth": "" if answer is None else str(answer)},
            "extra_info": {"question": entry["question"], "task": task, "settings": settings,
                           "seed": seed, "size": size, "index": index, "split": split,
                           **({"level": level} if level else {}),
                           "id": f"rg-{task}-{split}-L{level}-{index}"},
            "env": "reasoning_gym"}


def _task_rows(cfg: ReasoningGymConfig, split: str, skip: dict[str, set[str]]) -> list[dict]:
    names = cfg.task_names()
    if cfg.prompt not in rg().utils.SYSTEM_PROMPTS:
        raise ValueError(f"reasoning_gym.prompt={cfg.prompt!r}; valid: "
                         f"{', '.join(rg().utils.SYSTEM_PROMPTS)}")
    seed, total = (cfg.seed, cfg.size) if split == "train" else (cfg.eval_seed, cfg.eval_size)
    groups = []
    for task, count in zip(names, _shares(total, cfg.weights or [1.0] * len(names))):
        check_task(task)
        settings = cfg.settings(task)
        levels = task_levels(task, cfg.levels, settings, seed)
        for level, n in zip(levels, _shares(count, [1.0] * len(levels))):
            ds = dataset_of(task, level, settings, seed, n)
            rows, seen = [], set(skip.get(task, ()))
            for i in range(n):
                entry = ds[i]
                if entry["question"] in seen:
                    continue
                if split == "test":
                    seen.add(entry["question"])
                rows.append(make_row(task, level, settings, seed, n, i, entry, split,
                                     cfg.prompt, cfg.tool))
            if len(rows) < n:
                logger.info("reasoning_gym %s %s level %d: %d of %d rows kept (%s)", split,
                            task, level, len(rows), n, "repeated questions" if split == "test"
                            else "held-out questions skipped")
            groups.append(rows)
    return _proportional(groups)


def heldout_rows(reasoning_gym: ReasoningGymConfig) -> list[dict]:
    """``trainer.eval_data=test``: ``eval_size`` rows from ``eval_seed``, each question once."""
    return _task_rows(reasoning_gym, "test", {})


def train_rows(reasoning_gym: ReasoningGymConfig) -> list[dict]:
    """``data=train``: ``size`` rows from ``seed``, none a held-out question."""
    skip: dict[str, set[str]] = {}
    for row in heldout_rows(reasoning_gym):
        skip.setdefault(row["extra_info"]["task"], set()).add(row["extra_info"]["question"])
    return _task_rows(reasoning_gym, "train", skip)


def entry_of(row: dict):
    """The reasoning-gym dataset and entry a row was made from, regenerated."""
    info = row.get("extra_info") or {}
    missing = [k for k in ("task", "seed", "size", "index") if k not in info]
    if missing:
        raise ValueError(f"row {info.get('id', '?')} lacks extra_info {missing}: env="
                         f"reasoning_gym plays rows made by its datasets (data=train, test)")
    check_task(info["task"])
    ds = dataset_of(info["task"], int(info.get("level") or 0), info.get("settings") or {},
                    int(info["seed"]), int(info["size"]))
    entry = ds[int(info["index"])]
    if "question" in info and entry["question"] != info["question"]:
        raise ValueError(f"row {info.get('id', '?')}: reasoning-gym "
                         f"{getattr(rg(), '__version__', '?')} makes another question from "
                         f"its task, seed and index than the row holds; make the rows again "
                         f"with this version")
    return ds, entry


# -- the env ---------------------------------------------------------------------------
def answer_of(text: str) -> str | None:
    """The last ``<answer>…</answer>`` outside code, stripped (reasoning-gym's
    ``extract_answer``); None without one."""
    return rg().utils.extract_answer(_NOT_PROSE.sub("", text))


class ReasoningGymEnv(CodeEnv, env_id="agentgym/ReasoningGym-v0", short="reasoning_gym"):
    """A reasoning-gym task, scored by the task itself (see the module docstring).

    Args:
        tool: ``""`` (one reply, the answer) or ``code`` (the sandboxed interpreter: cells
            run until the answer or ``max_turns``).
        sandbox, obs_bytes, stateful: the code env's, used with ``tool=code``.
        max_turns: actions per episode with ``tool=code``.
        reward: ``score`` (the task's score, partial credit kept) or ``solved`` (1.0 when
            the score is 1.0, else 0.0).
    """

    stop_strings = ("</answer>",)

    def __init__(self, tool: str = "", sandbox=None, obs_bytes: int = 1024,
                 stateful: bool = False, max_turns: int | None = None,
                 reward: str = "score") -> None:
        super().__init__(sandbox=sandbox, obs_bytes=obs_bytes, stateful=stateful,
                         max_turns=max_turns)
        if tool not in PROTOCOLS:
            raise ValueError(f"tool={tool!r}; valid: '' (none), code")
        if reward not in REWARDS:
            raise ValueError(f"reward={reward!r}; valid: {', '.join(REWARDS)}")
        self.tool, self.reward = tool, reward
        if tool == "code":
            self.stop_strings = ("</code>", "</answer>")
        self._entry: dict = {}
        self._scorer = None
        self._task = ""

    def _reset(self, row):
        self._end_session()
        if row is None:
            row = self.pick_row(builtin_rows())
        self._scorer, self._entry = entry_of(row)
        self._task = row["extra_info"]["task"]
        self._golds = [str(row["reward_model"]["ground_truth"])]
        if self.tool == "code" and self.stateful:
            self._episodes += 1
            self._session = f"rg-{self._uid}-{self._episodes}"
        return [dict(m) for m in row["prompt"]], {"ground_truth": self._golds, "task": self._task}

    def _score(self, answer: str | None) -> tuple[float, dict]:
        try:
            score = float(self._scorer.score_answer(answer, self._entry))
        except Exception as e:  # noqa: BLE001 - a scorer that chokes on an answer scores 0
            logger.debug("%s: score_answer raised on %r: %s", self._task, answer, e)
            score = 0.0
        score = score if score == score else 0.0  # NaN: 0
        solved = float(score >= 1.0)
        return score if self.reward == "score" else solved, {
            "em": solved, "score": score, "answer": answer, "task": self._task,
            "ground_truth": self._golds}

    def _step(self, action, last_turn):
        answer = answer_of(action)
        if answer is not None or self.tool == "":
            self._end_session()
            if answer is None:
                self.count("malformed_actions")
            score, info = self._score(answer)
            return [], score, True, info
        if last_turn:
            self._end_session()
        m = _CODE.search(action)
        if m is None:
            self.count("malformed_actions")
            info = self._score(None)[1] if last_turn else {}
            return [{"role": "tool", "content": INVALID_ACTION}], 0.0, False, info
        fenced = _FENCE.search(m.group(1))
        code = (fenced.group(1) if fenced else m.group(1)).strip()
        if not code:
            self.count("malformed_actions")
            info = self._score(None)[1] if last_turn else {}
            return [self._interpreter(NO_CODE)], 0.0, False, info
        self.count("tool_calls")
        if last_turn:  # no turn left to use the output
            return [], 0.0, False, self._score(None)[1]
        return [self._interpreter(self._run(code))], 0.0, False, {}


@functools.lru_cache(maxsize=1)
def _builtin() -> tuple[dict, ...]:
    cfg = ReasoningGymConfig(size=4, eval_size=1)
    return tuple(_task_rows(cfg, "train", {}))


def builtin_rows() -> list[dict]:
    """``reset()`` without a row: four rows of the default task (contract checks)."""
    return [json.loads(json.dumps(r)) for r in _builtin()]


# -- what the trainer asks of it (envs.manifest) ----------------------------------------
def rg_kwargs(reasoning_gym: ReasoningGymConfig, code: CodeConfig,
              sandbox: SandboxConfig) -> dict:
    """The tool; with ``tool=code`` the code env's shared sandbox and output budget."""
    if reasoning_gym.tool != "code":
        return {"tool": "", "reward": reasoning_gym.reward}
    shared = code_kwargs(code, sandbox)
    return {"tool": "code", "sandbox": shared["sandbox"], "obs_bytes": shared["obs_bytes"],
            "stateful": shared["stateful"], "reward": reasoning_gym.reward}


def rg_demo(row: dict, env) -> dict | None:
    """A row's demonstration, kept when the task scores its answer 1.0: the answer alone,
    ``<answer>{answer}</answer>``; with ``tool=code``, for an entry whose metadata holds
    its arithmetic ``expression`` (``basic_arithmetic``, ``chain_sum``, …), a cell printing
    it, then the printed value as the answer. Other entries under the tool give none."""
    prompt, _ = env.reset(seed=0, options={"row": row})
    actions, observations = [], []
    if env.tool == "code":
        expression = (env._entry.get("metadata") or {}).get("expression")
        if not isinstance(expression, str) or not expression.strip():
            return None
        actions.append(f"Let me compute it with Python.\n<code>\n```python\n"
                       f"print({expression.strip()})\n```\n</code>")
        obs, _, terminated, truncated, _ = env.step(actions[-1])
        if terminated or truncated:
            return None
        observations.append(obs)
        text = "".join(m["content"] for m in obs)
        answer = text.split("<interpreter>")[-1].split("</interpreter>")[0].strip()
    else:
        answer = str(row["reward_model"]["ground_truth"])
    if not answer:
        return None
    actions.append(f"<answer>{answer}</answer>")
    _, reward, terminated, _, _ = env.step(actions[-1])
    if not terminated or reward < 1.0:
        return None
    return {"type": "demonstration", "env": "reasoning_gym",
            "builder": f"reasoning-gym-{env.tool or 'answer'}", "prompt": prompt,
            "actions": actions, "observations": observations, "reward": reward, "row": row}


def rg_sources(reasoning_gym: ReasoningGymConfig, code: CodeConfig, sandbox: SandboxConfig):
    """What the observations come from: the package's version; the sandbox with the tool."""
    out = {"reasoning_gym": getattr(rg(), "__version__", "?"), "tool": reasoning_gym.tool}
    if reasoning_gym.tool == "code":
        out.update(sandbox=asdict(sandbox), obs_bytes=code.obs_bytes)
    return out


MANIFEST = EnvManifest(
    sections={"reasoning_gym": ReasoningGymConfig, "code": CodeConfig, "sandbox": SandboxConfig},
    presets={"rollout.max_turns": 4, "trainer.eval_data": "test"},
    datasets={"train": train_rows, "test": heldout_rows},
    kwargs=rg_kwargs,
    demonstrate=rg_demo,
    sources=rg_sources,
    episode_metrics=("score",),
)
