"""The project's layers, read from its imports: the table the layering test enforces and the
picture in docs/ARCHITECTURE.md.

    python scripts/architecture.py   # check, print the unit graph, draw the PNG, write the table

Every ``import`` and ``from … import`` of the packages (function-level ones included) is
read with ``ast``; each module belongs to one unit (:data:`LAYERS`, lowest first), and a
unit may import only the units its row names. :func:`violations` lists the imports that
break that (a lower layer reaching up, or a sideways import not in the table) and
:func:`module_cycles` any import circle between modules; ``tests/test_layers.py`` asserts
both are empty. The picture is drawn from the same scan: one box a unit, on the row its
longest chain of imports puts it, an arrow for each unit-to-unit import; below it, the path
a trajectory takes, stage by stage, each with the function that does it (checked to exist).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the folders of the repository; installed, the last four are subpackages of agentgym
PACKAGES = ("agentgym", "envs", "tools", "trainers", "retriever_server")

_CORE, _SUP = "agentgym.core", "agentgym.supervision"
_TOOLS, _RETRIEVER = "agentgym.tools", "agentgym.retriever_server"
_ENVS, _TRAINERS = "agentgym.envs", "agentgym.trainers"
#: unit -> the units it may import, lowest layer first (a unit may always import itself)
LAYERS: dict[str, tuple[str, ...]] = {
    _CORE: (),
    _SUP: (_CORE,),
    _TOOLS: (_CORE, _SUP),
    _RETRIEVER: (_CORE, _SUP),
    _ENVS: (_CORE, _SUP, _TOOLS),
    "agentgym.presets": (_CORE, _ENVS),
    "agentgym.config": (_CORE, _SUP, "agentgym.presets", _ENVS),
    "agentgym.models": (_CORE,),
    "agentgym.rollout": (_CORE, _SUP, "agentgym.config", "agentgym.models", _ENVS),
    "agentgym.data": (_CORE, "agentgym.config", "agentgym.models", "agentgym.rollout", _ENVS),
    "agentgym.reporting": (_CORE, _SUP, "agentgym.rollout", _ENVS),
    "agentgym.serving": (_CORE, _SUP, "agentgym.models", "agentgym.rollout", _ENVS, _TOOLS),
    _TRAINERS: (_CORE, _SUP, "agentgym.config", "agentgym.models", "agentgym.rollout",
                "agentgym.data", "agentgym.reporting", "agentgym.serving", _ENVS),
    "agentgym.cli": (_CORE, _SUP, "agentgym.config", "agentgym.models", "agentgym.rollout",
                     "agentgym.data", "agentgym.reporting", "agentgym.serving", _TRAINERS,
                     _ENVS, _TOOLS, _RETRIEVER),
}
#: what each unit holds, one line (docs/ARCHITECTURE.md's table)
ROLES = {
    _CORE: "types (Trajectory: the loss mask), registry, choices, paths, device, memory",
    _SUP: "stage deadlines, supervised servers, hung calls, daemon pools",
    _TOOLS: "what envs call: retriever client and launcher, the code sandbox",
    _RETRIEVER: "the Search-R1 retrieval service (BM25, faiss)",
    _ENVS: "each env whole (config section, datasets, demos, metrics); checker, registry",
    "agentgym.presets": "algorithm presets, per-env keys, key shorthands, recipes",
    "agentgym.config": "the typed config (with the envs' sections), key=value overrides",
    "agentgym.models": "model zoo, tiny models, vision inputs",
    "agentgym.rollout": "generation manager, chat templates, engines (HF, SGLang), runtime",
    "agentgym.data": "rows read, filtered and mixed; demonstrations built and replayed",
    "agentgym.reporting": "metrics, eval (pass@k), stats, the inspector page",
    "agentgym.serving": "agentgym serve (SGLang / OpenAI API), agent endpoints",
    _TRAINERS: "one step loop (GRPO family, PPO), SFT, algos, backends, async, Ray",
    "agentgym.cli": "the agentgym command",
}
#: where each unit lives in the repository, and what it holds (docs/ARCHITECTURE.md's table,
#: written by :func:`write_docs`)
WHERE = {_CORE: "agentgym/core/", _SUP: "agentgym/supervision/", _TOOLS: "tools/",
         _RETRIEVER: "retriever_server/",
         _ENVS: "envs/", "agentgym.presets": "agentgym/presets.py",
         "agentgym.config": "agentgym/config.py", "agentgym.models": "agentgym/models/",
         "agentgym.rollout": "agentgym/rollout/", "agentgym.data": "agentgym/data/",
         "agentgym.reporting": "agentgym/reporting/", "agentgym.serving": "agentgym/serving/",
         _TRAINERS: "trainers/", "agentgym.cli": "agentgym/cli.py"}
HOLDS = {
    _CORE: "the ground floor: `types` (Trajectory, Segment, SamplingParams), `registry` (with "
           "`check_choices`), `choices` (the names a config may choose, stated for their "
           "owners), `paths`, `device`, `memory`, `overrides`, `recorded_graph`; with "
           "`agentgym/__init__.py` and `_layout.py` (the top-level folders as agentgym's "
           "subpackages in a checkout)",
    _SUP: "process and thread supervision: `watchdog` (stage deadlines, heartbeat, stack "
          "dumps), `supervisor` (servers restarted on failure), `server_process` (child "
          "servers that end with their parent), `stalls` (hung calls by site), "
          "`daemon_pool` (workers that replace a stuck one), `process_call`",
    _TOOLS: "what envs call: retriever client (`retriever.py`), local retriever launcher, the "
            "code sandbox (`sandbox.py` entry and `SandboxConfig`, `sandbox_base.py` contract, "
            "`sandbox_local.py` bubblewrap, `sandbox_e2b.py`), MCP servers (`mcp_client.py`, "
            "the `mcp_calculator.py` server)",
    _RETRIEVER: "the Search-R1 `/retrieve` service: BM25 and faiss indexes, batching",
    _ENVS: "each env whole, one module each (search, code, geometry, MCP tools; "
           "`agent_program` stands for `env=agent`): its class (the episodes) and its "
           "`MANIFEST` (config sections, presets, datasets, row filter, demonstrations: "
           "`search_demos`, `code_demos`; episode metrics; docs/ENVS.md); shared by all: "
           "`base` (the contract), `manifest` (what the trainer asks of an env), "
           "`registration` (ids, discovery), `checker`, `rewards`, `math_reward`, "
           "`function_calling`, `plugins`, `judge`",
    "agentgym.presets": "the layers a config is built from: each env's preset (its manifest's), "
                        "each algorithm's, key shorthands, the keys a mixed run sets per env "
                        "(`rollout.max_turns=[3,2]`), the recipes (`recipes/*.yaml`)",
    "agentgym.config": "the typed config, a field a section (the run's and the shipped "
                       "envs'; other envs' in `Config.sections`), `key=value` overrides",
    "agentgym.models": "`zoo` (names → local HF folders; loading), `tiny` (models built "
                       "locally), `shapes` (published configs, `tiny:SHAPE`), `plan` (the "
                       "memory planner), `vision`",
    "agentgym.rollout": "`manager` (the multi-turn loop), `writer` (token ids and the loss "
                        "mask, for rollouts, demonstrations and agents), `chat`, `context`, "
                        "`engines/` (HF: `core`, stepped by one thread, and its front; "
                        "SGLang client and launcher, weight sync), `runtime` (building them "
                        "from a config)",
    "agentgym.data": "`rows` (datasets read, filtered and mixed; held-out sets), `demos` "
                     "(replay, conversion, filters), `demo_builders` (runs an env's builder)",
    "agentgym.reporting": "`metrics` (JSONL, TensorBoard, PNG, W&B), `evaluation` (EM, "
                          "pass@k), `stats`, `inspector`",
    "agentgym.serving": "`serve` (`agentgym serve`: SGLang's native API and OpenAI's; "
                        "`native_params`, what its `/generate` accepts), "
                        "`openai_api` / `openai_chat` / `openai_stream` (OpenAI's API over any "
                        "engine), `agents` (`env=agent`: an endpoint per episode)",
    _TRAINERS: "`loop` (`train`, the one entry, and the one step loop), `phases` (what each "
               "step does), `session` (the run around the steps), rollout collection and the step sources `collection` (sync) "
               "and `async_steps`, `curriculum`; workers `workers` (this process) and "
               "`ray_cluster`; `cold_start/` (the stage, its probe, demonstrations, SFT and "
               "records), `sft`; `algos` (with `group_stats`, "
               "`turn_credit`, `rollout_correction`), `backends/` (with `factory`: the backend a "
               "config names), `packing` (the pack), `attention` (its "
               "kernels, registered in transformers), `balancing` (the micro-batches) and "
               "`fused_head` (the vocabulary head), "
               "`critic`, `lora`, "
               "`sample_log`, `hooks`, `checkpoints` (the run directory, its checkpoints and "
               "resume), `reference` (frozen scorers: the KL reference, a teacher's model)",
    "agentgym.cli": "the `agentgym` command: it owns printing and progress bars",
}
DOC = ROOT / "docs" / "ARCHITECTURE.md"
_BEGIN, _END = "<!-- floors: written by scripts/architecture.py -->", "<!-- floors end -->"


def floors_table() -> str:
    """docs/ARCHITECTURE.md's table of units, from :data:`LAYERS`, lowest floor first."""
    lv = levels({u: set(allowed) for u, allowed in LAYERS.items()})
    short = lambda u: u.removeprefix("agentgym.")  # noqa: E731
    rows = ["| unit | where | what lives there | may import |", "|---|---|---|---|"]
    for u in sorted(LAYERS, key=lambda u: (lv[u], list(LAYERS).index(u))):
        allowed = ", ".join(short(a) for a in LAYERS[u]) or "nothing of the project"
        if u == "agentgym.cli":
            allowed = "everything"
        rows.append(f"| `{u}` | `{WHERE[u]}` | {HOLDS[u]} | {allowed} |")
    return "\n".join(rows)


def documented_table() -> str:
    """The table as docs/ARCHITECTURE.md holds it now."""
    text = DOC.read_text(encoding="utf-8")
    return text[text.index(_BEGIN) + len(_BEGIN):text.index(_END)].strip()


def write_docs() -> None:
    text = DOC.read_text(encoding="utf-8")
    a, b = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
    DOC.write_text(text[:a] + "\n" + floors_table() + "\n" + text[b:], encoding="utf-8")


#: the path a trajectory takes, stage by stage: (stage, module, the function that does it,
#: what it hands on). :func:`check_path` verifies each function is defined there.
TRAJECTORY = [
    ("data", "agentgym.data.rows", "training_rows", "rows (a question, its gold answers)"),
    ("step", "agentgym.trainers.collection", "collect", "this step's prompts x n"),
    ("manager", "agentgym.rollout.manager", "play",
     "token ids in, the loss mask built turn by turn"),
    ("engine", "agentgym.rollout.engines.hf", "generate", "sampled ids + their logprobs"),
    ("env", "agentgym.envs.base", "step", "an action parsed, an observation back"),
    ("trainer", "agentgym.trainers.phases", "update_policy",
     "Trajectory batch: mask, logprobs, advantages"),
    ("weights", "agentgym.trainers.session", "sync",
     "new weights into the engine (version + 1)"),
]


def check_path() -> list[str]:
    """The stages of :data:`TRAJECTORY` whose function is not defined in their module."""
    mods = modules()
    missing = []
    for stage, module, fn, _ in TRAJECTORY:
        tree = ast.parse(mods[module].read_text(encoding="utf-8"))
        names = {n.name for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if fn not in names:
            missing.append(f"{stage}: {module} defines no {fn}")
    return missing


def module_name(path: Path) -> str:
    """A file's dotted name as installed: ``envs/search.py`` is ``agentgym.envs.search``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] != "agentgym":
        parts = ("agentgym", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the packages: dotted name (as installed) -> file."""
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def unit_of(module: str) -> str:
    """The unit a module belongs to (the package root and its layout finder: the ground
    floor)."""
    if module in ("agentgym", "agentgym._layout"):
        return _CORE
    for unit in sorted(LAYERS, key=len, reverse=True):
        if module == unit or module.startswith(unit + "."):
            return unit
    raise KeyError(f"module {module} belongs to no unit of scripts/architecture.py LAYERS; "
                   f"add its package there (and to docs/ARCHITECTURE.md)")


#: a registry string: ``"package.module:Attr"`` (envs, algorithms, rewards, plugins)
_SPEC = re.compile(r"^(agentgym(?:\.\w+)+):\w+$")


def imports(mods: dict[str, Path] | None = None, registry: bool = True
            ) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file): ``import`` and
    ``from … import``, relative ones resolved against the module's package, and (with
    ``registry``) the ``"package.module:Attr"`` strings it registers: loaded later, so no
    import circle, but a dependency the layers must allow all the same."""
    mods = mods or modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from .x import y / from .. import z
                    up = package.split(".")
                    up = up[:len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            elif registry and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and (m := _SPEC.match(node.value)):
                targets = [m.group(1)]
            else:
                continue
            for t in targets:
                if t.split(".")[0] == "agentgym" and (r := resolve(t)) and r != name:
                    deps.add(r)
        out[name] = deps
    return out


def unit_graph(deps: dict[str, set[str]]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = defaultdict(set)
    for m, ds in deps.items():
        for d in ds:
            if unit_of(d) != unit_of(m):
                g[unit_of(m)].add(unit_of(d))
    return g


def violations(deps: dict[str, set[str]]) -> list[str]:
    """Imports the table does not allow, as ``module -> module (unit -> unit)``."""
    bad = []
    for m, ds in sorted(deps.items()):
        for d in sorted(ds):
            a, b = unit_of(m), unit_of(d)
            if a != b and b not in LAYERS[a]:
                bad.append(f"{m} -> {d} ({a} may not import {b})")
    return bad


def module_cycles(deps: dict[str, set[str]]) -> list[list[str]]:
    """Import circles between modules (strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in deps.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return found


def levels(g: dict[str, set[str]]) -> dict[str, int]:
    """Each unit's row: 0 for units that import none, else 1 + the highest they import."""
    memo: dict[str, int] = {}

    def level(u: str) -> int:
        if u not in memo:
            memo[u] = 0
            memo[u] = 1 + max((level(d) for d in g.get(u, ())), default=-1)
        return memo[u]

    return {u: level(u) for u in LAYERS}


def draw(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    g = unit_graph(imports())
    lv = levels(g)
    rows: dict[int, list[str]] = defaultdict(list)
    for u in LAYERS:
        rows[lv[u]].append(u)
    pos, W, H = {}, 3.4, 0.62
    for r, units in rows.items():
        for i, u in enumerate(units):
            pos[u] = ((i - (len(units) - 1) / 2) * (W + 0.45), r * 1.45)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(15, 13.5), dpi=110,
                                 gridspec_kw={"height_ratios": [4.2, 1]})

    def box(axes, x, y, w, title, sub, colour):
        axes.add_patch(FancyBboxPatch((x - w / 2, y - H / 2), w, H, boxstyle="round,pad=0.04",
                                      fc=colour, ec="#34495e", lw=1.2, zorder=3))
        axes.text(x, y + 0.1, title, ha="center", va="center", fontsize=9.5, weight="bold",
                  zorder=4)
        axes.text(x, y - 0.15, sub, ha="center", va="center", fontsize=6.2, zorder=4)

    for u, (x, y) in pos.items():
        outside = u in (_TOOLS, _RETRIEVER, _ENVS, _TRAINERS)  # folders beside agentgym/
        box(ax, x, y, W, u, ROLES[u], "#f3f3f3" if outside else "#eef3fb")
    for a, bs in g.items():
        for b in bs:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            ax.add_patch(FancyArrowPatch((x1, y1 - H / 2), (x2, y2 + H / 2), arrowstyle="-|>",
                                         mutation_scale=9, lw=0.7, alpha=0.6, zorder=1,
                                         color="#7f8c8d" if b in LAYERS[a] else "#c0392b"))
    xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - W / 2 - 0.3, max(xs) + W / 2 + 0.3)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax.axis("off")
    ax.set_title("AgentGym's layers, drawn from the imports (python scripts/architecture.py): one "
                 "box a unit, an arrow for each import between units,\nevery one pointing down "
                 "(red would be an import the layering does not allow)", fontsize=10)
    n = len(TRAJECTORY)
    for k, (stage, module, fn, what) in enumerate(TRAJECTORY):
        x = k * 2.2
        box(bx, x, 0, 2.0, stage, f"{module}\n.{fn}", "#fdf2e9")
        bx.text(x, -0.62, what, ha="center", va="top", fontsize=6.5, wrap=True)
        if k < n - 1:
            bx.add_patch(FancyArrowPatch((x + 1.02, 0), (x + 1.18, 0), arrowstyle="-|>",
                                         mutation_scale=12, lw=1.5, color="#e67e22"))
    bx.add_patch(FancyArrowPatch(((n - 1) * 2.2, H / 2 + 0.02), (3 * 2.2, H / 2 + 0.02),
                                 arrowstyle="-|>", mutation_scale=12, lw=1.5, color="#e67e22",
                                 connectionstyle="arc3,rad=0.35"))
    bx.set_xlim(-1.2, (n - 1) * 2.2 + 1.2)
    bx.set_ylim(-1.3, 1.3)
    bx.axis("off")
    bx.set_title("The path a trajectory takes (each stage: the module and the function that does "
                 "it; the weights go back to the engine for the next step)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    deps = imports()
    bad, circles, missing = violations(deps), module_cycles(imports(registry=False)), check_path()
    g = unit_graph(deps)
    lv = levels(g)
    for u in sorted(LAYERS, key=lambda u: (lv[u], u)):
        print(f"row {lv[u]}  {u:20s} imports {', '.join(sorted(g.get(u, ()))) or '-'}")
    for line in bad:
        print("not allowed:", line)
    for c in circles:
        print("circle:", " <-> ".join(c))
    for line in missing:
        print("trajectory path:", line)
    out = ROOT / "docs" / "architecture.png"
    draw(out)
    write_docs()
    print(f"wrote {out} and {DOC}'s table of floors")
    return 1 if bad or circles or missing else 0


if __name__ == "__main__":
    sys.exit(main())
