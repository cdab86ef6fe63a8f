"""``data.curriculum=solve_rate``: train on what the policy solves sometimes.

A group-relative advantage learns only from groups whose rewards differ. A prompt the
policy never solves, or always solves, gives every sample the same reward and teaches
nothing; a small model on a hard task sees almost only the first kind. This sampler keeps
each step's prompts where the *sampled solve rate* (the share of a group's samples that
solved the prompt: ``info["em"]`` when the env reports it, else ``reward >= 1``) is inside
``data.curriculum_band`` (default ``[0.2, 0.8]``), and moves on as they are mastered.

* **By level**, when the rows carry ``extra_info.level`` (``data=arith``; search rows
  ordered by difficulty, :func:`agentgym.envs.answerable.difficulty_levels`): a step's
  prompts come from the *current level*, in a shuffled order per level. The level's recent solve rate is the mean over its last
  :data:`WINDOW` groups; once at least :data:`MIN_GROUPS` are in and it is above the
  band, the level counts as mastered and the next one becomes current. The run starts at
  the lowest level, so a level the model already masters costs a step or two and the
  curriculum settles where it is in the band by itself.
* **By row**, when no row has a level: rows are taken in order, as without a curriculum,
  but a row whose last group solved more than the band's top is retired (never drawn
  again), and one whose last group solved less than the band's bottom sits out the next
  pass over the data; when nothing is left to draw, every row is back.

A mixed run (rows of several envs, ``env=[search,code]``): each env has its own sampler
over its own rows, by level or by row as its rows say; a step's slots go to the envs in
the order of the mixed rows (``data.mix``'s shares), and each env's metrics are prefixed
with its name (``code/curriculum/level``).

Step metrics: ``curriculum/level`` (the current level), ``curriculum/solve_rate_L<k>``
(the recent solve rate of each level seen), ``curriculum/in_band`` (the share of this
step's groups inside the band) and, by row, ``curriculum/retired`` (the share of rows
retired). ``rollout/signal_groups`` (groups with reward variance) sits beside them.
The sampler's state is part of every checkpoint, so a resumed run continues where it was.
"""

from __future__ import annotations

import collections
import logging
import random

logger = logging.getLogger(__name__)

WINDOW = 16  # groups per level in its recent solve rate
MIN_GROUPS = 8  # groups of a level seen before it can count as mastered


def solved(tr) -> float:
    """1.0 if a trajectory solved its prompt."""
    if "em" in tr.info:
        return float(float(tr.info["em"]) >= 1.0)
    return float(tr.reward >= 1.0)


def level_of(row: dict):
    return (row.get("extra_info") or {}).get("level")


class Curriculum:
    """The sampler: :meth:`take` the next prompts, :meth:`observe` their groups."""

    def __init__(self, rows: list[dict], band: tuple[float, float], seed: int,
                 state: dict | None = None) -> None:
        lo, hi = band
        self.rows, self.lo, self.hi = rows, lo, hi
        found = sorted({level_of(r) for r in rows} - {None})
        self.by_level = bool(found)
        if self.by_level:
            if any(level_of(r) is None for r in rows):
                raise ValueError("data.curriculum=solve_rate: some rows have "
                                 "extra_info.level and some do not; give every row a level "
                                 "or none")
            self.levels = found
            self.order = {}
            for lv in found:  # row indices of each level, in a seeded order
                idx = [i for i, r in enumerate(rows) if level_of(r) == lv]
                random.Random(f"{seed}:{lv}").shuffle(idx)
                self.order[lv] = idx
        st = state or {}
        self.at = st.get("at", 0)  # index of the current level
        self.pos = {int(k): v for k, v in st.get("pos", {}).items()}  # level -> next in order
        self.recent = {int(k): collections.deque(v, WINDOW)
                       for k, v in st.get("recent", {}).items()}
        self.rate = {int(k): v for k, v in st.get("rate", {}).items()}  # row -> last rate
        self.cursor = st.get("cursor", 0)  # by row: next row
        self.passes = st.get("passes", 0)
        self.benched = {int(k): v for k, v in st.get("benched", {}).items()}  # row -> pass it sits out
        self.in_band = 0.0

    def state(self) -> dict:
        """What a checkpoint keeps (JSON)."""
        return {"at": self.at, "pos": self.pos, "recent": {k: list(v) for k, v in
                                                           self.recent.items()},
                "rate": self.rate, "cursor": self.cursor, "passes": self.passes,
                "benched": self.benched}

    @property
    def level(self):
        return self.levels[self.at] if self.by_level else None

    def take(self, k: int) -> list[int]:
        """Indices of the next ``k`` rows to roll out."""
        if self.by_level:
            order = self.order[self.level]
            start = self.pos.get(self.level, 0)
            self.pos[self.level] = start + k
            return [order[(start + i) % len(order)] for i in range(k)]
        out: list[int] = []
        looked = 0  # rows passed over since the last one taken
        while len(out) < k:
            if looked >= len(self.rows):  # a whole pass found nothing: every row is back
                logger.info("curriculum: every row retired or sitting out; all %d rows are "
                            "back", len(self.rows))
                self.rate.clear()
                self.benched.clear()
                looked = 0
            i = self.cursor % len(self.rows)
            self.cursor += 1
            looked += 1
            if i == 0 and self.cursor > 1:
                self.passes += 1
            if self.rate.get(i, 0.0) > self.hi or self.benched.get(i) == self.passes:
                continue
            out.append(i)
            looked = 0
        return out

    def observe(self, picked: list[int], trajs: list, n: int) -> dict:
        """Record the groups of ``picked`` (``trajs``: ``n`` per row, in order; episodes
        that hit an infrastructure failure do not count); return the step's metrics."""
        from agentgym.trainers.collection import infra_failed  # lazy: loads torch
        inside = counted = 0
        for g, i in enumerate(picked):
            group = [tr for tr in trajs[g * n:(g + 1) * n] if not infra_failed(tr)]
            if not group:
                continue
            rate = sum(map(solved, group)) / len(group)
            counted += 1
            inside += self.lo <= rate <= self.hi
            if self.by_level:
                self.recent.setdefault(level_of(self.rows[i]), collections.deque(maxlen=WINDOW)
                                       ).append(rate)
            else:
                self.rate[i] = rate
                if rate < self.lo:
                    self.benched[i] = self.passes + 1
        self.in_band = inside / counted if counted else 0.0
        if self.by_level:
            self._advance()
        return self.metrics()

    def _advance(self) -> None:
        recent = self.recent.get(self.level, ())
        if len(recent) < MIN_GROUPS or self.at + 1 >= len(self.levels):
            return
        mean = sum(recent) / len(recent)
        if mean > self.hi:
            logger.info("curriculum: level %s mastered (solve rate %.2f over its last %d "
                        "groups > %.2f); moving to level %s", self.level, mean, len(recent),
                        self.hi, self.levels[self.at + 1])
            self.at += 1

    def metrics(self) -> dict:
        m = {"curriculum/in_band": self.in_band}
        if self.by_level:
            m["curriculum/level"] = float(self.level)
            for lv, r in self.recent.items():
                m[f"curriculum/solve_rate_L{lv}"] = sum(r) / len(r)
        else:
            m["curriculum/retired"] = sum(v > self.hi for v in self.rate.values()) / len(self.rows)
        return m


class MixedCurriculum:
    """One :class:`Curriculum` per env of a mixed run; :meth:`take` fills each slot from
    the env the mixed row order gives it."""

    def __init__(self, rows: list[dict], band: tuple[float, float], seed: int,
                 state: dict | None = None) -> None:
        st = state or {}
        self.rows, self.slot = rows, st.get("slot", 0)
        self.index = {}  # env -> global row indices of its rows
        for i, row in enumerate(rows):
            self.index.setdefault(row["env"], []).append(i)
        self.local = {i: j for idx in self.index.values() for j, i in enumerate(idx)}
        self.parts = {env: Curriculum([rows[i] for i in idx], band, seed,
                                      st.get("parts", {}).get(env))
                      for env, idx in self.index.items()}

    def state(self) -> dict:
        return {"slot": self.slot, "parts": {e: c.state() for e, c in self.parts.items()}}

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            env = self.rows[self.slot % len(self.rows)]["env"]
            self.slot += 1
            out.append(self.index[env][self.parts[env].take(1)[0]])
        return out

    def observe(self, picked: list[int], trajs: list, n: int) -> dict:
        m = {}
        for env, cur in self.parts.items():
            mine = [g for g, i in enumerate(picked) if self.rows[i]["env"] == env]
            if not mine:
                continue
            got = cur.observe([self.local[picked[g]] for g in mine],
                              [tr for g in mine for tr in trajs[g * n:(g + 1) * n]], n)
            m.update({f"{env}/{k}": v for k, v in got.items()})
        return m


def make_curriculum(rows: list[dict], band: tuple[float, float], seed: int,
                    state: dict | None = None):
    """The sampler for ``rows``: :class:`MixedCurriculum` when they hold several envs."""
    if len({row.get("env") for row in rows}) > 1:
        return MixedCurriculum(rows, band, seed, state)
    return Curriculum(rows, band, seed, state)
