"""Does ``agentgym inspect``'s page stay fast with thousands of samples?

    python bench/inspect_page.py --sizes 100,1000,5000 [--run RUN_DIR]

Takes the samples of a run (``--run``; default: a real 2-step ``tiny`` run on search with
``trainer.log_samples=3``, made here), repeats them as further steps up to each size, writes
the page and opens it in headless Chromium (playwright, Debian's chromium): the page's size,
the seconds to write it, to load it until its list is ready, to apply a filter and to open
one sample's token view. The baseline in the same run is the eager page a simpler design
would be: every sample's token view built at load (measured by opening them all at once).
Figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentgym.reporting.inspector import write_page  # noqa: E402
from bench.report import machine, write_section  # noqa: E402


def _tiny_run(work: Path) -> Path:
    run = work / "tiny"
    subprocess.run([sys.executable, "-m", "agentgym.cli", "train", "env=search", "model=tiny",
                    "trainer.total_steps=2", "trainer.prompts_per_step=2", "n=4",
                    "rollout.max_tokens_per_turn=24", "rollout.max_response_tokens=256",
                    "trainer.eval_limit=0", "trainer.cold_start=off", "trainer.log_samples=3",
                    f"run_dir={run}"], check=True, stdout=subprocess.DEVNULL)
    return run


def _grow(run: Path, size: int, out: Path) -> Path:
    """A run directory whose samples are ``run``'s repeated as further steps up to ``size``."""
    base = []
    for f in sorted((run / "samples").glob("step_*.jsonl")):
        base += [json.loads(x) for x in f.read_text().splitlines()]
    (out / "samples").mkdir(parents=True)
    per_step = 3
    for step in range(1, size // per_step + 1):
        rows = [dict(base[(step * per_step + j) % len(base)], step=step) for j in range(per_step)]
        (out / "samples" / f"step_{step}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    metrics = [{"step": s, "rollout/reward": 0.1 * (s % 7)} for s in range(1, size // per_step + 1)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return out


def _measure(page_path: Path, exe: str) -> dict:
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            t0 = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=600_000)
            ready = time.perf_counter() - t0
            filt = page.evaluate("""() => { const t = performance.now();
                const el = document.getElementById('f-rank'); el.value = 'best';
                el.dispatchEvent(new Event('input')); document.body.offsetHeight;
                const ms = performance.now() - t; el.value = '';
                el.dispatchEvent(new Event('input')); return ms; }""") / 1000
            one = page.evaluate("""() => { const t = performance.now();
                const c = document.querySelector('details.sample'); c.open = true;
                render(c); document.body.offsetHeight; return performance.now() - t; }""") / 1000
            eager = page.evaluate("""() => { const t = performance.now();
                for (const c of document.querySelectorAll('details.sample')) render(c);
                document.body.offsetHeight; return performance.now() - t; }""") / 1000
            return {"ready_s": ready, "filter_s": filt, "open_one_s": one,
                    "eager_extra_s": eager}
        finally:
            browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--run", default="", help="a run directory with samples/ (default: make one)")
    args = ap.parse_args()
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentgym-inspect-bench-") as tmp:
        work = Path(tmp)
        run = Path(args.run) if args.run else _tiny_run(work)
        for size in (int(s) for s in args.sizes.split(",")):
            grown = _grow(run, size, work / f"n{size}")
            t0 = time.perf_counter()
            page = write_page(grown)
            write_s = time.perf_counter() - t0
            m = _measure(page, exe)
            n = len(list((grown / "samples").glob("*.jsonl"))) * 3
            tokens = sum(len(json.loads(x)["token_ids"]) for f in (grown / "samples").glob("*.jsonl")
                         for x in f.read_text().splitlines())
            rows.append((n, tokens, page.stat().st_size / 2**20, write_s, m))
            print(f"{n} samples: {page.stat().st_size / 2**20:.1f} MiB, write {write_s:.2f}s, "
                  f"ready {m['ready_s']:.2f}s, eager +{m['eager_extra_s']:.2f}s", flush=True)
    table = ["| samples | tokens | page (MiB) | write (s) | load until ready (s) | filter (s) | "
             "open one sample (s) | eager: build every token view (s) | eager / lazy load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, tokens, mib, write_s, m in rows:
        table.append(f"| {n} | {tokens} | {mib:.1f} | {write_s:.2f} | {m['ready_s']:.2f} | "
                     f"{m['filter_s']:.3f} | {m['open_one_s']:.3f} | {m['eager_extra_s']:.2f} | "
                     f"{(m['ready_s'] + m['eager_extra_s']) / m['ready_s']:.1f}x |")
    body = (f"Machine: {machine()}. Command: `python bench/inspect_page.py --sizes {args.sizes}"
            f"{' --run ' + args.run if args.run else ''}`. Samples of a real run repeated as "
            f"further steps; headless Chromium ({Path(exe).name}) through playwright; "
            f"'ready' is from navigation to the list built; the eager column is what building "
            f"every sample's token view at load would add (all rendered at once).\n\n"
            + "\n".join(table) + "\n")
    write_section("Inspector page with thousands of samples", body)


if __name__ == "__main__":
    main()
