"""See what the policy did: samples per step, the inspector page in a real headless
Chromium, W&B offline logging, and pass@k / maj@k of ``agentgym eval``.

One real 2-step mixed run of ``tiny`` (search and code, so two envs to filter by) with
``trainer.log_samples=3`` and ``logger=wandb`` in W&B's offline mode feeds the tests."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
from pathlib import Path

import psutil
import pytest

from agentgym.cli import main

RANKS = ["worst", "median", "best"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, retriever_url):
    run = tmp_path_factory.mktemp("inspect") / "run"
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT", "WANDB_PROJECT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_PROJECT="agentgym-test")
    try:
        assert main(["train", "env=[search,code]", "model=tiny", f"run_dir={run}",
                     "trainer.total_steps=2", "trainer.prompts_per_step=4", "n=2", "limit=8",
                     "trainer.eval_limit=2", f"retriever.url={retriever_url}",
                     "rollout.max_tokens_per_turn=8", "rollout.max_turns=2",
                     "trainer.log_samples=3", "logger=wandb", "trainer.cold_start=off"]) == 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return run


def _samples(run: Path) -> list[dict]:
    out = []
    for f in sorted((run / "samples").glob("step_*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return out


def test_samples_per_step_hold_what_a_debugger_needs(run, tiny_tokenizer):
    files = sorted(p.name for p in (run / "samples").iterdir())
    assert files == ["step_1.jsonl", "step_2.jsonl"]
    for step in (1, 2):
        rows = [json.loads(x) for x in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert [r["rank"] for r in rows] == RANKS and all(r["step"] == step for r in rows)
        assert rows[0]["reward"] <= rows[1]["reward"] <= rows[2]["reward"]
        for r in rows:
            n = len(r["token_ids"])
            assert n == len(r["tokens"]) == len(r["loss_mask"]) == len(r["engine_logprobs"]) \
                == len(r["trainer_logprobs"]) == len(r["advantages"])
            assert r["tokens"] == [tiny_tokenizer.decode([i]) for i in r["token_ids"]]
            # segments tile the sequence; the mask is 1 exactly on generated segments
            assert r["segments"][0]["start"] == 0 and r["segments"][-1]["end"] == n
            for seg in r["segments"]:
                want = 1 if seg["kind"] == "generated" else 0
                assert set(r["loss_mask"][seg["start"]:seg["end"]]) == {want}
                assert seg["text"] == "".join(r["tokens"][seg["start"]:seg["end"]])
            assert {s["kind"] for s in r["segments"]} >= {"prompt", "generated"}
            assert r["env"] in ("search", "code")
            sampled = [i for i, m in enumerate(r["loss_mask"]) if m]
            # the trainer's logprobs are the sampled tokens' own (non-zero, close to the engine's)
            assert all(r["trainer_logprobs"][i] < 0 for i in sampled)
            assert max(abs(r["trainer_logprobs"][i] - r["engine_logprobs"][i]) for i in sampled) < 0.05
            assert all(r["trainer_logprobs"][i] == 0 and r["advantages"][i] == 0
                       for i, m in enumerate(r["loss_mask"]) if not m)


def test_pick_spreads_over_the_reward_order():
    from agentgym.trainers.sample_log import pick
    rewards = [0.5, 0.0, 1.0, 0.25, 0.75]
    assert pick(rewards, 3) == [(1, "worst"), (0, "median"), (2, "best")]
    assert pick(rewards, 1) == [(0, "median")]
    assert pick(rewards, 0) == [] and pick([], 3) == []
    assert [i for i, _ in pick([0.0, 0.0], 3)] == [0, 1]  # ties: the earlier one first


def _browser():
    from playwright.sync_api import sync_playwright
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("no chromium on PATH: `make install` installs Debian's chromium "
                    "(apt-get install chromium)")
    return sync_playwright, exe


def _open_page(browser, page_path: Path):
    """The inspector page opened from disk (every other request refused) once its script
    has run; the page's uncaught errors collect in the list returned with it."""
    page = browser.new_page(viewport={"width": 1300, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.abort()
               if not route.request.url.startswith("file://") else route.continue_())
    page.goto(page_path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    return page, errors


def _check_token_colours(page, cards, samples: list[dict]) -> None:
    """Every token's colour class matches the loss mask, once the sample is opened."""
    for i, s in enumerate(samples):
        card = cards.nth(i)
        assert card.get_attribute("data-step") == str(s["step"])
        card.locator("summary").click()
        # the page builds the token view in its `toggle` handler, which the browser
        # runs as a task of its own after the click: wait for it, then read
        idx = card.get_attribute("data-idx")
        page.wait_for_selector(f"details.sample[data-idx='{idx}'][data-rendered='1']",
                               state="attached", timeout=60_000)
        got = card.evaluate("c => [...c.querySelectorAll('.tok')].map("
                            "t => t.classList.contains('m1') ? 1 : t.classList.contains('m0') ? 0 : -1)")
        assert got == s["loss_mask"], f"sample {i}: colouring differs from the mask"
    # the two classes really are coloured differently
    colours = page.evaluate("""() => ['m1', 'm0'].map(c => getComputedStyle(
        document.querySelector('.seg .tok.' + c)).backgroundColor)""")
    assert colours[0] != colours[1]


def _check_hover_tip(page, cards, first: dict) -> None:
    """Hovering the first sample's first sampled token shows its logprob gap and advantage."""
    j = first["loss_mask"].index(1)
    cards.nth(0).locator(f".tok[data-i='{j}']").hover()
    page.wait_for_function(  # the tip is written by the mouseover handler
        "p => document.querySelector('#tip').textContent.includes(p)",
        arg=f"position {j}\n", timeout=60_000)
    tip = page.locator("#tip").inner_text()
    assert f"engine logprob {first['engine_logprobs'][j]:.4f}" in tip
    assert f"advantage {first['advantages'][j]:.4f}" in tip
    gap = first["trainer_logprobs"][j] - first["engine_logprobs"][j]
    assert f"gap {gap:.4f}" in tip  # the same double arithmetic as the page's


def _visible(page, cards, expected: list[int]) -> list[int]:
    """The indices of the cards shown, once they are ``expected`` (or after 60 s)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # the filters run in the controls' input handlers: wait until the cards they
    # leave shown are the expected ones (or 60 s), then read what is visible
    try:
        page.wait_for_function(
            "w => JSON.stringify([...document.querySelectorAll("
            "'details.sample:not(.hidden)')].map(c => +c.dataset.idx)) === w",
            arg=json.dumps(expected, separators=(",", ":")), timeout=60_000)
    except PlaywrightTimeout:
        pass  # the caller's assertion shows what is shown instead
    return [int(c.get_attribute("data-idx")) for c in cards.all() if c.is_visible()]


def _check_filters(page, cards, samples: list[dict]) -> None:
    """The step, env, rank and minimum-reward filters each show exactly their samples."""
    want = list(range(len(samples)))
    assert _visible(page, cards, want) == want
    page.select_option("#f-step", "2")
    want = [i for i, s in enumerate(samples) if s["step"] == 2]
    assert _visible(page, cards, want) == want
    assert not page.locator(".stephead[data-step='1']").is_visible()
    page.select_option("#f-step", "")
    envs = sorted({s["env"] for s in samples})
    for env in envs:
        page.select_option("#f-env", env)
        want = [i for i, s in enumerate(samples) if s["env"] == env]
        assert _visible(page, cards, want) == want
    page.select_option("#f-env", "")
    page.select_option("#f-rank", "best")
    want = [i for i, s in enumerate(samples) if s["rank"] == "best"]
    assert _visible(page, cards, want) == want
    page.select_option("#f-rank", "")
    top = max(s["reward"] for s in samples)
    page.fill("#f-rmin", str(top + 1))
    want = []
    assert _visible(page, cards, want) == want
    assert page.locator("#shown").inner_text() == f"showing 0 of {len(samples)}"
    page.fill("#f-rmin", str(min(s["reward"] for s in samples)))
    want = list(range(len(samples)))
    assert _visible(page, cards, want) == want


def test_inspector_page_in_headless_chromium(run, tmp_path, capsys):
    assert main(["inspect", str(run)]) == 0
    page_path = run / "inspect.html"
    assert str(page_path) in capsys.readouterr().out
    samples = _samples(run)
    sync_playwright, exe = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            page, errors = _open_page(browser, page_path)
            cards = page.locator("details.sample")
            assert cards.count() == len(samples) == 6  # every sample present
            _check_token_colours(page, cards, samples)
            _check_hover_tip(page, cards, samples[0])
            _check_filters(page, cards, samples)
            # the run's curves on the same page
            assert page.locator("#curve polyline").count() >= 1
            shot = tmp_path / "inspect.png"
            page.screenshot(path=str(shot), full_page=False)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
            assert errors == []
        finally:
            browser.close()


def test_inspect_reads_a_rollout_file_and_rejects_other_files(tmp_path, retriever_url):
    out = tmp_path / "traj.jsonl"
    assert main(["rollout", "env=search", "model=tiny", "n=2", "limit=2", f"out={out}",
                 f"retriever.url={retriever_url}", "rollout.max_tokens_per_turn=8",
                 "rollout.max_turns=2"]) == 0
    assert main(["inspect", str(out)]) == 0
    html = out.with_suffix(".html").read_text()
    assert html.count('"mk":') == 4  # four trajectories embedded
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*token_ids"):
        from agentgym.reporting.inspector import write_page
        write_page(bad)
    assert main(["inspect", str(tmp_path / "missing")]) == 2  # a clear error, not a trace


def _wandb_records(path: Path):
    """The records of an offline ``run-*.wandb`` file (LevelDB log format: 32 KiB blocks of
    7-byte-headed chunks, after W&B's 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_logs_the_metrics_samples_and_curves(run):
    runs = glob.glob(str(run / "wandb" / "offline-run-*"))
    assert len(runs) == 1, runs
    offline = Path(runs[0])
    assert offline.name.endswith((run / "wandb_id").read_text().strip())
    history = {}
    for rec in _wandb_records(next(offline.glob("run-*.wandb"))):
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in rec.history.item}
            history[int(row["_step"])] = row
        elif rec.WhichOneof("record_type") == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    assert config["env"] == "search,code" and config["trainer"]["log_samples"] == 3
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # every metrics.jsonl line is a W&B history row of the same step
        row = history[m["step"]]
        for k, v in m.items():
            if k != "step":
                assert row[k] == pytest.approx(v), (m["step"], k)
    for step in (1, 2):  # the step's samples as a table
        assert history[step]["samples/_type"] == "table-file"
    tables = sorted(offline.glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 2
    for t in tables:
        table = json.loads(t.read_text())
        assert table["columns"][:5] == ["step", "rank", "env", "uid", "reward"]
        assert [r[1] for r in table["data"]] == RANKS
    assert list(offline.glob("files/media/images/curves/reward_curve_*.png"))
    # the W&B service ended with the run
    assert not [c for c in psutil.Process().children(recursive=True)
                if "wandb" in " ".join(c.cmdline())]


def test_pass_at_k_matches_hand_computed_values():
    from agentgym.reporting.stats import pass_at_k
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(3, 0, 2) == 0.0 and pass_at_k(3, 2, 2) == 1.0
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)


def test_majority_vote_over_normalised_answers():
    from agentgym.reporting.evaluation import majority_correct
    from agentgym.core.types import Trajectory

    def t(answer, em, done=True):
        return Trajectory(terminated=done, info={"answer": answer, "em": em})

    assert majority_correct([t("Paris", 1), t("the paris", 1), t("Lyon", 0)])
    assert not majority_correct([t("Lyon", 0), t("Paris", 1), t("lyon.", 0)])
    assert majority_correct([t("Paris", 1), t("Lyon", 0)])  # a tie: the first seen
    assert not majority_correct([t("Paris", 1, done=False)])  # no answer, no vote


def test_eval_k_reports_pass_at_k_and_maj_at_k(tmp_path, retriever_url, capsys):
    from agentgym.reporting.stats import pass_at_k
    out = tmp_path / "pass.json"
    assert main(["eval", "env=search", "model=tiny", "k=4", "limit=3", f"out={out}",
                 f"retriever.url={retriever_url}", "rollout.max_tokens_per_turn=8",
                 "rollout.max_turns=2"]) == 0
    printed = capsys.readouterr().out
    assert "3 questions x 4 samples (temperature 1)" in printed and "maj@4" in printed
    r = json.loads(out.read_text())
    assert r["k"] == 4 and r["n"] == 12 and r["n_questions"] == 3
    assert len(r["episodes"]) == 12 and len(r["questions"]) == 3
    for q in r["questions"]:
        eps = [e for e in r["episodes"] if e["uid"] == q["uid"]]
        assert q["samples"] == 4 and q["correct"] == sum(e["em"] >= 1 for e in eps)
        for j in (1, 2, 4):
            assert q[f"pass@{j}"] == pytest.approx(pass_at_k(4, q["correct"], j))
    for j in (1, 2, 4):
        assert r[f"pass@{j}"] == pytest.approx(sum(q[f"pass@{j}"] for q in r["questions"]) / 3)
        lo, hi = r[f"pass@{j}_ci95"]
        assert lo <= r[f"pass@{j}"] <= hi
    assert r["em"] == pytest.approx(r["pass@1"])
    assert main(["eval", "env=search", "model=tiny", "k=4", "rollout.temperature=0"]) == 2
    assert main(["compare", str(out), str(out)]) == 2  # k samples are not paired answers
