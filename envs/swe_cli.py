"""``agentgym swe ...``: the SWE env's own commands (its manifest's ``commands``).

    agentgym swe validate data=FILE [swe.repos=FOLDER] [limit=N] [workers=2]

``validate`` runs every row's gold ``patch`` and an empty diff through the harness
(:func:`agentgym.envs.swe_grade.grade`) and prints, per row and in total, which resolve.
Exit status 1 when a gold patch does not resolve or an empty diff does (a row whose
tests cannot tell a fix from no change), 0 when every row is as it should be.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time

USAGE = ("usage: agentgym swe validate data=FILE [swe.repos=FOLDER] [limit=N] [workers=N] "
         "[key=value ...]")


def _validate_row(env_kwargs: dict, row: dict) -> tuple[dict, object, object]:
    from agentgym.envs.swe import repo_cache, workspace_root
    from agentgym.envs.swe_grade import grade
    from agentgym.envs.swe_rows import find_repo
    from agentgym.tools.workspace import CommandLimits
    base = repo_cache().base(row["repo"], find_repo(row, env_kwargs["repos"]), row["base_commit"])
    limits = CommandLimits(wall_s=env_kwargs["test_s"], cpu_s=env_kwargs["test_s"],
                           memory_mb=env_kwargs["memory_mb"], max_procs=env_kwargs["max_procs"],
                           disk_mb=env_kwargs["disk_mb"])
    run = lambda diff: grade(row, base, diff, workspace_root(), limits,  # noqa: E731
                             env_kwargs["test_s"], env_kwargs["python"] or None)
    return row, run(str(row.get("patch") or "")), run("")


def _verdict(g) -> str:
    if g.infra:
        return f"harness failed ({g.infra[:120]})"
    return (f"{'resolved' if g.resolved else 'not resolved'} (F2P {g.f2p:.2f}, P2P {g.p2p:.2f}"
            f"{'' if g.applied else ', did not apply'})")


def validate(args: list[str]) -> int:
    from agentgym.config import build_config
    from agentgym.core.overrides import parse_overrides
    from agentgym.data.rows import load_rows
    from agentgym.envs.swe import swe_kwargs
    keys = parse_overrides(args)
    workers = int(keys.pop("workers", 2))
    if "data" not in keys and "data.name" not in keys:
        raise ValueError(f"validate needs data=FILE (rows in SWE-bench's schema); {USAGE}")
    cfg = build_config({**keys, "env": "swe"})
    rows = load_rows("swe", cfg.data.name, cfg.limit, cfg)
    kwargs = swe_kwargs(cfg.section("swe"))
    bad, t0 = 0, time.perf_counter()
    print(f"validating {len(rows)} rows of {cfg.data.name}: the gold patch and an empty diff "
          f"each")
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for row, gold, empty in pool.map(lambda r: _validate_row(kwargs, r), rows):
            ok = gold.resolved and not empty.resolved and not empty.infra
            bad += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {row['instance_id']}: gold {_verdict(gold)}; "
                  f"empty diff {_verdict(empty)}; tests {gold.test_s:.1f} s")
    print(f"{len(rows) - bad} of {len(rows)} rows valid (the gold patch resolves, an empty "
          f"diff does not) in {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0


SUBCOMMANDS = {"validate": validate}


def main(args: list[str]) -> int:
    if not args or args[0] not in SUBCOMMANDS:
        print(f"{USAGE}\nsubcommands: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return SUBCOMMANDS[args[0]](args[1:])
