"""`dew report`'s page, opened in a real headless browser (tests/browser/open_page.py:
Qt WebEngine, Chromium's engine, offscreen), shows every plot and the latest text
previews. Run by the `browser` nox session, which installs PyQt6-WebEngine."""

import json
import os
import pathlib
import subprocess
import sys

from dew.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
LM = str(ROOT / "recipes" / "lm_scratch.yaml")
PLOTS = ["training loss", "evaluation", "learning rate", "throughput", "goodput"]


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
    opened = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).with_name("open_page.py")),
         os.path.join(run_dir, "report.html")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert opened.returncode == 0, opened.stderr[-3000:]
    page = json.loads(opened.stdout.splitlines()[-1])
    assert page["title"] == "dew report: run", page
    # every plot decoded by the browser, at the size matplotlib drew it, and laid out
    images = {image["alt"]: image for image in page["images"]}
    for name in PLOTS:
        assert (images[name]["width"], images[name]["height"]) == (640, 360), images[name]
        assert images[name]["shown"] > 0, images[name]
    # the text previews of the evaluations at steps 2 and 4, as the run wrote them
    previews = sorted(pathlib.Path(run_dir, "previews").glob("*.txt"))
    assert [p.name for p in previews] == ["step_00000002.txt", "step_00000004.txt"]
    assert "text previews" in page["headings"]
    assert [p.read_text() for p in previews] == page["texts"][: len(previews)]
