"""`dew report`'s page, opened in a real headless browser (tests/browser/open_page.py:
Qt WebEngine, Chromium's engine, offscreen), shows every plot and the latest text
previews; for a run of each family kind (LM, DPO, GRPO, diffusion, BD3-LM: metric
logs in the run-folder format with the keys those runs write), training and
evaluation loss share a panel, each headline metric has its own, counts are a table,
and a screenshot of the whole page is kept (pytest's tmp folder, `report-FAMILY.png`;
DEW_REPORT_SCREENSHOTS=DIR keeps them there) for a person to read. Run by the
`browser` nox session, which installs PyQt6-WebEngine."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from dew.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = str(ROOT / "recipes" / "lm_scratch.yaml")
PLOTS = ["loss", "accuracy", "perplexity", "learning rate", "tokens per second", "goodput"]
SIZE = (580, 280)  # pixels of every panel


def opened(*pages: str) -> list[dict]:
    """What the browser shows of each page (``PAGE`` or ``PAGE SHOT PAGE SHOT ...``)."""
    command = [sys.executable, str(pathlib.Path(__file__).with_name("open_page.py")), *pages]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    return [json.loads(line) for line in shown.stdout.splitlines() if line.startswith("{")]


def test_the_report_page_shows_its_plots_and_previews_in_a_browser(tmp_path):
    run_dir = str(tmp_path / "run")
    overrides = [
        "trainer.steps=4",
        "trainer.log_every=1",
        "trainer.eval_every=2",
        "trainer.eval_batches=1",
        "optimizer.schedule.warmup_steps=1",
        "model.config.num_layers=1",
        f"run_dir={run_dir}",
    ]
    assert main(["--quiet", "train", LM, *overrides]) == 0
    assert main(["--quiet", "report", run_dir]) == 0
    (page,) = opened(os.path.join(run_dir, "report.html"))
    assert page["title"] == "dew report: run", page
    # every plot decoded by the browser, at the size matplotlib drew it, and laid out
    images = {image["alt"]: image for image in page["images"]}
    for name in PLOTS:
        assert (images[name]["width"], images[name]["height"]) == SIZE, images[name]
        assert images[name]["shown"] > 0, images[name]
    # the text previews of the evaluations at steps 2 and 4, as the run wrote them
    previews = sorted(pathlib.Path(run_dir, "previews").glob("*.txt"))
    assert [p.name for p in previews] == ["step_00000002.txt", "step_00000004.txt"]
    assert "text previews" in page["headings"]
    assert [p.read_text() for p in previews] == page["texts"][: len(previews)]


# The keys each family's run writes (read from tiny runs of the shipped recipes), with
# curves of plausible shape: a loss falling over two decades, a reward rising, ...
TRAIN_COMMON = ("grad_norm", "learning_rate", "rejected_fraction",
                "step_seconds", "examples_per_second", "mfu", "step_flops")  # fmt: skip
DPO = ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected", "logp_chosen",
       "logp_rejected", "nll_chosen", "pairs")  # fmt: skip
DPO_LOSSES = {"train": ("loss", "dpo_loss", "nll_chosen"), "eval": ("loss", "nll_chosen")}
FAMILIES = {
    "lm": {
        "train": ("loss", "nll", "tokens", "tokens_per_second"),
        "eval": ("loss", "perplexity", "accuracy", "tokens"),
        "ema": True,
        "panels": {
            "loss": ["loss (train)", "nll (train)", "loss (eval, EMA)", "loss (eval)"],
            "accuracy": ["accuracy (eval, EMA)", "accuracy (eval)"],
            "perplexity": ["perplexity (eval, EMA)", "perplexity (eval)"],
        },
        "counts": ["tokens (train)", "tokens (eval, EMA)"],
    },
    "dpo": {
        "train": ("loss", "dpo_loss", *DPO[1:]),
        "eval": DPO,
        "ema": False,
        "panels": {
            "loss": [f"{k} ({kind})" for kind in ("train", "eval") for k in DPO_LOSSES[kind]],
            "reward": [f"{k} ({kind})" for kind in ("train", "eval") for k in DPO[2:5]],
            "accuracy": ["accuracy (train)", "accuracy (eval)"],
        },
        "counts": ["pairs (train)", "pairs (eval)"],
    },
    "grpo": {
        "train": (
            "loss",
            "reward",
            "reward/exact_answer",
            "reward/answer_prefix",
            "kl",
            "clip_fraction",
            "zero_variance_fraction",
            "ratio",
            "completion_length",
            "rollout_tokens",
            "tokens",
            "tokens_per_second",
            "prepare_seconds",
        ),
        "eval": ("reward", "reward/exact_answer", "reward/answer_prefix"),
        "ema": False,
        "panels": {
            "loss": ["loss (train)"],
            "reward": [
                "reward (train)",
                "reward/exact_answer (train)",
                "reward/answer_prefix (train)",
                "reward (eval)",
                "reward/exact_answer (eval)",
                "reward/answer_prefix (eval)",
            ],
            "KL": ["kl (train)"],
        },
        "counts": ["completion_length (train)", "rollout_tokens (train)"],
    },
    "diffusion": {
        "train": ("loss", "mse", "loss_t0-0.33", "loss_t0.33-0.67", "loss_t0.67-1"),
        "eval": ("loss", "loss_t0.1", "loss_t0.5", "loss_t0.9"),
        "ema": True,
        "panels": {
            "loss": ["loss (train)", "mse (train)", "loss (eval, EMA)", "loss (eval)"],
            "loss per noise level (eval)": [
                "loss_t0.1 (eval, EMA)",
                "loss_t0.5 (eval, EMA)",
                "loss_t0.9 (eval, EMA)",
                "loss_t0.1 (eval)",
                "loss_t0.5 (eval)",
                "loss_t0.9 (eval)",
            ],
        },
        "counts": ["step_flops (train)"],
    },
    "block_diffusion": {
        "train": ("loss", "nelbo", "nll_masked", "masked", "tokens", "tokens_per_second"),
        "eval": (
            "nelbo",
            "nelbo_stderr",
            "perplexity_bound",
            "clip0_loss",
            "clip1_loss",
            "clip0_variance",
            "clip1_variance",
            "clip_beta",
            "clip_omega",
            "tokens",
        ),
        "ema": True,
        "panels": {
            "loss": ["loss (train)", "nll_masked (train)"],
            "bound": ["nelbo (train)", "nelbo (eval, EMA)", "nelbo (eval)"],
            "perplexity": ["perplexity_bound (eval, EMA)", "perplexity_bound (eval)"],
            "clip loss": [
                "clip0_loss (eval, EMA)",
                "clip1_loss (eval, EMA)",
                "clip0_loss (eval)",
                "clip1_loss (eval)",
            ],
        },
        "counts": ["masked (train)", "tokens (eval, EMA)"],
    },
}


def value(key: str, step: int, rng) -> float:
    """A plausible value of ``key`` at ``step`` (of 200)."""
    t = step / 200
    noise = 1 + 0.05 * rng.standard_normal()
    if "loss" in key or "nll" in key or key in ("nelbo", "mse"):
        return 5.0 * 0.02**t * noise  # two decades
    if "perplexity" in key:
        return float(np.exp(5.0 * 0.02**t))
    if "reward" in key or key == "margin":
        return (t if "rejected" not in key else -t) * noise
    if key == "rejected_fraction":
        return 0.0  # no step rejected: a constant, tabulated rather than plotted
    if key in ("accuracy", "clip_fraction", "zero_variance_fraction"):
        return min(1.0, (0.5 + 0.45 * t) * noise)
    if key == "learning_rate":
        return 3e-3 * min(1.0, step / 20) * 0.5 * (1 + np.cos(np.pi * t))
    if key.endswith("per_second"):
        return (8000.0 if "tokens" in key else 500.0) * noise
    return abs(noise) * (100.0 if key in ("tokens", "pairs", "masked", "step_flops") else 1.0)


def write_run(run_dir: pathlib.Path, family: str) -> None:
    spec, rng = FAMILIES[family], np.random.default_rng(0)
    run_dir.mkdir()
    rows = []
    for step in range(10, 201, 10):
        keys = spec["train"] + TRAIN_COMMON
        rows.append({"step": step, "kind": "train", "time": 0.0,
                     **{k: value(k, step, rng) for k in keys}})  # fmt: skip
        if step % 50 == 0:
            row = {"step": step, "kind": "eval", "time": 0.0, "ema": float(spec["ema"])}
            row.update({k: value(k, step, rng) for k in spec["eval"]})
            if spec["ema"]:  # the averaged weights' row holds the live weights' as live/
                row.update({f"live/{k}": 1.1 * value(k, step, rng) for k in spec["eval"]})
            rows.append(row)
    phases = ("init", "compile", "steps", "data", "eval", "checkpoint")
    rows.append({"step": 200, "kind": "goodput", "wall": 30.0, "first_step": 8.0,
                 **{p: float(i + 1) for i, p in enumerate(phases)}})  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "status.json").write_text(json.dumps({"status": "finished", "step": 200}))
    (run_dir / "recipe.yaml").write_text(f"objective: {{name: {family}}}\n")


@pytest.fixture(scope="module")
def family_pages(tmp_path_factory):
    """Each family's report, opened in one browser, with a screenshot of each."""
    root = tmp_path_factory.mktemp("families")
    shots = pathlib.Path(os.environ.get("DEW_REPORT_SCREENSHOTS", root))
    shots.mkdir(parents=True, exist_ok=True)
    arguments = []
    for family in FAMILIES:
        write_run(root / family, family)
        assert main(["--quiet", "report", str(root / family)]) == 0
        arguments += [str(root / family / "report.html"), str(shots / f"report-{family}.png")]
    pages = opened(*arguments)
    assert len(pages) == len(FAMILIES), pages
    return dict(zip(FAMILIES, pages, strict=True)), shots


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_report_of_each_family_is_readable(family, family_pages):
    pages, shots = family_pages
    page = pages[family]
    assert page["title"] == f"dew report: {family}", page
    panels = {p["alt"]: p for p in page["panels"]}
    spec = FAMILIES[family]
    # training and evaluation loss on one panel; each headline metric a panel of its own
    for name, series in spec["panels"].items():
        assert panels[name]["series"] == series, (name, panels[name])
    # a loss over two decades on a log scale; accuracy, reward and rates stay linear
    for name in ("loss", "bound"):
        if name in panels and any("(eval" in s for s in panels[name]["series"]):
            assert panels[name]["scale"] == "log", panels[name]
    for name in ("accuracy", "reward", "tokens per second", "examples per second"):
        if name in panels:
            assert panels[name]["scale"] == "linear", panels[name]
    # throughputs apart; counts a table, in no panel
    assert "examples per second" in panels
    plotted = {s for p in panels.values() for s in p["series"]}
    for count in spec["counts"]:
        assert count in page["table"] and count not in plotted, count
    assert "step_flops (train)" in page["table"]
    assert "rejected_fraction (train)" in page["table"] or "fractions" in panels
    images = {image["alt"]: image for image in page["images"]}
    for name in panels:
        assert (images[name]["width"], images[name]["height"]) == SIZE, images[name]
        assert images[name]["shown"] > 0, images[name]
    assert (shots / f"report-{family}.png").stat().st_size > 10_000
