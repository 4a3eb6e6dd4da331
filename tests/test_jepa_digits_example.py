"""examples/jepa_digits.py runs end to end (a few steps) and prints its three probe lines
for the random-init, context and target encoders; the random-init ViT's linear probe
on digits is the strong baseline docs/jepa.md describes (about 0.92)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_digits_example_prints_probes_against_the_random_init_baseline():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/jepa_digits.py"), "--steps", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() if "accuracy" in x]
    titles = [x.split(":")[0] for x in lines]
    assert titles == [
        "linear probe accuracy (1400 labels)",
        "linear probe accuracy (100 labels)",
        "k-NN accuracy (k=20, 1400 labels)",
    ]
    for line in lines:
        scores = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
        assert list(scores) == ["random-init encoder", "context encoder", "target encoder"]
        assert all(0.0 <= float(s) <= 1.0 for s in scores.values()), line
    full = dict(part.rsplit(" ", 1) for part in lines[0].split(": ", 1)[1].split(", "))
    # 10 classes (chance 0.1): a random ViT's pooled features already separate digits
    assert float(full["random-init encoder"]) >= 0.85, lines[0]
