"""Every example in examples/ runs with the command its header documents (README.md's
for the quickstart), `uv run --locked python examples/NAME.py`, from a fresh clone:
what it imports is what that command installs (the root dev group holds
`dew-jax[examples]`: scikit-learn's digits, pillow).

All examples share one clone and environment per pytest process (conftest.py), each
runs with few steps (the arguments of its own test in tests/ where it has one, so the
persistent compilation cache already holds its programs) and on one CPU device, as in
a user's shell. None reads the network (the digits are scikit-learn's bundled copy,
the other data is generated): the runs are offline (`HF_HUB_OFFLINE`,
`HF_DATASETS_OFFLINE`, `UV_OFFLINE`), so an example that starts downloading fails here.
Each must run to the line it prints at its end; where an example has no test of its own
in tests/ (the quickstart, the digits examples), ``CHECKS`` below also checks what it
printed and wrote, so each of them runs once in CI, not twice.
"""

from __future__ import annotations

import ast
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

# name -> (few-steps arguments, the start of a line it prints at its end)
RUNS = {
    # the seed's program, verbatim from docs/quickstart.md: its 100 steps, no arguments
    "quickstart.py": ([], "dew trains jax"),
    "dpo.py": (["--steps", "2"], "share of token 3 in samples: reference "),
    "grpo_arithmetic.py": (["--iterations", "4"], "greedy accuracy after: "),
    "distill_pretrained.py": (["--steps", "4"], "wrote the student to "),
    "jepa_waves.py": (["--steps", "20"], "features of 4 images: (4, 64)"),
    "jepa_digits.py": (["--steps", "4"], "k-NN accuracy (k=20, 1400 labels): "),
    # small enough for CI and still the check (check_flow_grpo_digits)
    "flow_grpo_digits.py": (
        "--pretrain-steps 800 --iterations 30 --patch-size 4 --emb-features 48 --sde-steps 6 "
        "--learning-rate 2e-4".split(),
        "wrote runs/flow_grpo_digits/before.png and runs/flow_grpo_digits/after.png",
    ),
    "masked_diffusion.py": (
        ["--steps", "2", "--seq-len", "8", "--blocks", "4", "--batch", "4", "--eval-times", "2"],
        "trained 3 models for 2 steps on ",
    ),
    "diffusion_digits.py": (
        ["--steps", "8"],
        "wrote runs/diffusion_digits/samples.png and the pipeline runs/diffusion_digits/pipeline",
    ),
}


def check_quickstart(lines: list[str], clone) -> None:
    """The seed's printed lines: the start line, a falling loss, goodput, the sample."""
    assert lines[0] == (
        "Training from step 0 to 100 on {'data': 1, 'expert': 1, 'fsdp': 1, 'tensor': 1, "
        "'sequence': 1, 'stage': 1} (1 process(es))"
    )
    losses = {}
    for step in (25, 50, 75, 100):
        line = next(x for x in lines if x.startswith(f"step {step}: loss "))
        losses[step] = float(line.split("loss ")[1].split(",")[0])
    assert losses[100] <= 0.01 and losses[25] > losses[100], losses
    goodput = next(x for x in lines if x.startswith("Goodput: "))
    assert re.match(
        r"Goodput: first step after \d+\.\d\d s, \d+\.\d% of the wall time in steps", goodput
    )
    assert lines[-1] == "dew trains jax models. dew trains jax model"


# run in the clone's own environment (numpy and pillow are there, not in this session's)
DIFFUSION_FILES = """
import numpy as np
from PIL import Image
out = "runs/diffusion_digits/"
for step in (2, 4, 6, 8):
    with Image.open(out + f"previews/step_{step:08d}.png") as preview:
        assert preview.size == (40, 32) and preview.mode == "L", (preview.size, preview.mode)
with Image.open(out + "samples.png") as grid:
    pixels = np.asarray(grid)
assert pixels.shape == (128, 320), pixels.shape
np.testing.assert_array_equal(pixels[::4, ::4].repeat(4, 0).repeat(4, 1), pixels)
print("files ok")
"""


def check_diffusion_digits(lines: list[str], clone) -> None:
    """Previews every 8 // 4 = 2 steps (20 samples in a 5 x 4 grid of 8 x 8 digits), the
    4 x 10 sample grid upscaled 4x by nearest neighbour, and the saved pipeline (the
    example itself asserts that the pipeline loads back to the same samples)."""
    assert (clone.path / "runs" / "diffusion_digits" / "pipeline" / "dew_config.json").exists()
    run = clone.run(["uv", "run", "--locked", "--offline", "python", "-c", DIFFUSION_FILES], 120)
    assert run.returncode == 0 and "files ok" in run.stdout, run.stderr[-3000:]


def check_jepa_digits(lines: list[str], clone) -> None:
    """Three probe lines for the random-init, context and target encoders; the
    random-init ViT's linear probe is the strong baseline docs/jepa.md describes."""
    probes = [x for x in lines if "accuracy" in x]
    assert [x.split(":")[0] for x in probes] == [
        "linear probe accuracy (1400 labels)",
        "linear probe accuracy (100 labels)",
        "k-NN accuracy (k=20, 1400 labels)",
    ]
    for line in probes:
        scores = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
        assert list(scores) == ["random-init encoder", "context encoder", "target encoder"]
        assert all(0.0 <= float(s) <= 1.0 for s in scores.values()), line
    full = dict(part.rsplit(" ", 1) for part in probes[0].split(": ", 1)[1].split(", "))
    # 10 classes (chance 0.1): a random ViT's pooled features already separate digits
    assert float(full["random-init encoder"]) >= 0.85, probes[0]


def check_flow_grpo_digits(lines: list[str], clone) -> None:
    """The issue's digits check: the classifier's probability of a 3 for ODE samples
    of the null label rises >= 3x while their pixel mean and std stay within 0.05 of
    the data's (no reward hacking into noise); both grids are 4 x 10 digits, 4x."""
    found = {}
    for name in ("before", "after"):
        line = next(x for x in lines if x.startswith(f"{name}: reward "))
        numbers = re.fullmatch(
            rf"{name}: reward (\S+), pixel mean (\S+) std (\S+) \(data (\S+), (\S+)\)", line
        )
        assert numbers, line
        found[name] = [float(v) for v in numbers.groups()]
    before, after = found["before"], found["after"]
    assert after[0] >= 3 * before[0], (before, after)
    assert abs(after[1] - after[3]) <= 0.05 and abs(after[2] - after[4]) <= 0.05, after
    for name in ("before", "after"):
        assert (clone.path / "runs" / "flow_grpo_digits" / f"{name}.png").exists()


CHECKS = {
    "quickstart.py": check_quickstart,
    "diffusion_digits.py": check_diffusion_digits,
    "flow_grpo_digits.py": check_flow_grpo_digits,
    "jepa_digits.py": check_jepa_digits,
}


def documented_command(name: str) -> list[str]:
    """The command the example's docstring gives (README.md's for the quickstart, the
    seed's program, which has no docstring), without its optional ``[--flag N]`` parts."""
    if name == "quickstart.py":
        readme = (ROOT / "README.md").read_text()
        setup = next(b for b in re.findall(r"^```\n(.*?)^```", readme, re.S | re.M) if name in b)
        lines = [setup.split("&&")[-1]]  # `python -m pip install -q uv && uv run ...`
    else:
        doc = ast.get_docstring(ast.parse((ROOT / "examples" / name).read_text())) or ""
        lines = [x for x in doc.splitlines() if x.strip().startswith("uv run ")]
    assert len(lines) == 1, f"examples/{name} documents {len(lines)} `uv run` commands: {lines}"
    return shlex.split(re.sub(r"\s*\[[^\]]*\]", "", lines[0]))


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_documents_the_readme_form(name):
    assert name in RUNS, (
        f"examples/{name} is new: give RUNS in {__file__} its few-steps arguments and "
        f"the start of its last line, so CI runs it as documented"
    )
    assert documented_command(name) == ["uv", "run", "--locked", "python", f"examples/{name}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_as_documented_in_a_fresh_clone(name, fresh_clone):
    args, last_line = RUNS[name]
    command = documented_command(name) + args
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "UV_OFFLINE": "1"}
    run = fresh_clone.run(command, timeout=600, **offline)
    assert run.returncode == 0, f"{shlex.join(command)} failed:\n{run.stderr[-3000:]}"
    lines = run.stdout.splitlines()
    assert any(line.startswith(last_line) for line in lines), (last_line, lines[-5:])
    if name in CHECKS:
        CHECKS[name](lines, fresh_clone)
