"""The seed's program, examples/quickstart.py, runs as the users' page shows."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_prints_the_seed_output():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples/quickstart.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0] == (
        "Training from step 0 to 100 on {'data': 1, 'expert': 1, 'fsdp': 1, 'tensor': 1, "
        "'sequence': 1, 'stage': 1} (1 process(es))"
    )
    losses = {}
    for step in (25, 50, 75, 100):
        line = next(x for x in lines if x.startswith(f"step {step}: loss "))
        losses[step] = float(line.split("loss ")[1].split(",")[0])
    assert losses[100] <= 0.01
    assert losses[25] > losses[100]
    goodput = next(x for x in lines if x.startswith("Goodput: "))
    assert re.match(
        r"Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps", goodput
    )
    assert lines[-1] == "dew trains jax models. dew trains jax model"


def test_quickstart_is_the_seed_program_unchanged():
    seed = ROOT.parent / "shared" / "key-concepts.md"
    if not seed.exists():
        pytest.skip("shared/key-concepts.md is not beside this checkout")
    text = seed.read_text()
    program = text[text.index("import itertools") : text.index("On four cores")].strip()
    assert (ROOT / "examples/quickstart.py").read_text().strip() == program
