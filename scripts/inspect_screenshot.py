"""Screenshot of a run's inspector page, as a person sees it: a sample opened, its least
likely sampled token hovered (its logprobs and advantage in the tooltip).

    python scripts/inspect_screenshot.py RUN_DIR docs/inspect_smollm2.png [--sample N]

Writes ``RUN_DIR/inspect.html`` (``agentgym inspect``) and opens it in headless Chromium
(playwright with Debian's chromium).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from playwright.sync_api import sync_playwright

    from agentgym.reporting.inspector import write_page

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("out")
    ap.add_argument("--sample", type=int, default=2, help="which sample to open (0-based)")
    args = ap.parse_args()
    page_path = write_page(args.run_dir).resolve()
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(page_path.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=120_000)
            card = page.locator("details.sample").nth(args.sample)
            card.locator("summary").click()
            prompt = card.locator(".seg.k-prompt")
            prompt.evaluate("e => e.style.maxHeight = '90px'")  # the long instructions
            prompt.evaluate("e => e.style.overflow = 'hidden'")
            # the sampled token the engine found least likely: its logprobs say something
            i = card.evaluate("""c => { const s = S[+c.dataset.idx]; let best = -1;
                for (let i = 0; i < s.el.length; i++)
                    if (s.mk[i] === "1" && (best < 0 || s.el[i] < s.el[best])) best = i;
                return best; }""")
            card.locator(f".tok[data-i='{i}']").hover()
            page.screenshot(path=args.out, full_page=False)
        finally:
            browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
