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
What the examples compute is checked by their own tests in tests/; here each must run
to the line it prints at its end.
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
    "jepa_waves.py": (["--steps", "20"], "features of 4 images: (4, 64)"),
    "jepa_digits.py": (["--steps", "4"], "k-NN accuracy (k=20, 1400 labels): "),
    "masked_diffusion.py": (
        ["--steps", "2", "--seq-len", "8", "--blocks", "4", "--batch", "4", "--eval-times", "2"],
        "trained 3 models for 2 steps on ",
    ),
    "diffusion_digits.py": (
        ["--steps", "8"],
        "wrote runs/diffusion_digits/samples.png and the pipeline runs/diffusion_digits/pipeline",
    ),
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
