"""The peer suite: the seed-size and medium GPT-2-style LM trained by Dew and by
what a user would pick instead, each side in its own process, alternating,
ratios against Dew printed as a table (goal, issue 15: Dew >= 1.1x eager torch
and >= 1.2x the best JAX peer).

Sides and how each is installed (a side whose interpreter is missing is
reported as not installed, never dropped):

- ``dew``, ``hand``: tools/bench_peers/jax_sides.py in the workspace venv
  (``.venv``; ``hand`` = a plain flax.linen GPT-2 in a hand-written jitted loop);
- ``torch``: tools/bench_peers/torch_gpt2.py, eager PyTorch, 2 threads, in a venv
  with the local CPU wheel: ``python -m venv /tmp/torchenv &&
  /tmp/torchenv/bin/pip install torch==2.13.0``;
- ``maxtext``, ``tunix``, ``levanter``: each needs its own venv (``--venv
  maxtext=/tmp/maxtext/bin/python``) and a runner script of its own, which this
  suite does not have yet: reported as "not run (no runner)" or "not installed".

    python tools/bench_peers/run.py --sizes seed medium --repeats 3
    python tools/bench_peers/run.py --venv torch=/tmp/torchenv/bin/python --sizes seed

Definitions, the same for every side: tokens/s after the first step (wall
time of steps 2..N), time to the first step from process start (imports,
initialisation, compilation, one step).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
SIZES = ("seed", "medium")
SCRIPTS = {"dew": "jax_sides.py", "hand": "jax_sides.py", "torch": "torch_gpt2.py"}
PEERS_WITHOUT_RUNNER = ("maxtext", "tunix", "levanter")
DEFAULT_VENVS = {
    "dew": str(ROOT / ".venv/bin/python"),
    "hand": str(ROOT / ".venv/bin/python"),
    "torch": "/tmp/torchenv/bin/python",
}
LINE = re.compile(r": ([\d,]+) tokens/s after the first step, first step ([\d.]+) s")


def parse_venvs(pairs: list[str]) -> dict[str, str]:
    venvs = dict(DEFAULT_VENVS)
    known = [*SCRIPTS, *PEERS_WITHOUT_RUNNER]
    for pair in pairs:
        name, _, path = pair.partition("=")
        if name not in known or not path:
            raise SystemExit(f"--venv {pair!r}: use NAME=PYTHON with NAME one of {known}")
        if not os.path.exists(path):
            raise SystemExit(f"--venv {pair!r}: no interpreter at {path!r}; install the peer first")
        venvs[name] = path
    return venvs


def run_side(side: str, python: str, size: str, steps: int) -> tuple[float, float] | str:
    if not os.path.exists(python):
        return f"not installed (no {python})"
    args = [python, str(HERE / SCRIPTS[side]), "--size", size, "--steps", str(steps)]
    if side in ("dew", "hand"):
        args += ["--side", side]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # one CPU device for every JAX side
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    m = LINE.search(done.stdout)
    if done.returncode or not m:
        return f"failed (rc {done.returncode}): {done.stderr.strip()[-200:]}"
    return float(m.group(1).replace(",", "")), float(m.group(2))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--sides", nargs="+", default=["dew", "hand", "torch"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--venv", nargs="*", default=[], metavar="NAME=PYTHON")
    args = parser.parse_args(argv)
    for size in args.sizes:
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; use one of {list(SIZES)}")
    for side in args.sides:
        if side not in (*SCRIPTS, *PEERS_WITHOUT_RUNNER):
            raise SystemExit(f"unknown side {side!r}; use {[*SCRIPTS, *PEERS_WITHOUT_RUNNER]}")
    venvs = parse_venvs(args.venv)
    print("| size | side | tokens/s | Dew / side | first step s | side / Dew first step |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        results: dict[str, list] = {side: [] for side in args.sides}
        runnable = [s for s in args.sides if s in SCRIPTS]
        for r in range(args.repeats):
            order = runnable[r % len(runnable) :] + runnable[: r % len(runnable)]
            for side in order:
                results[side].append(run_side(side, venvs[side], size, args.steps))
        ok = {s: [x for x in v if isinstance(x, tuple)] for s, v in results.items()}
        dew = ok.get("dew") or []
        d_rate = statistics.median(x[0] for x in dew) if dew else float("nan")
        d_first = statistics.median(x[1] for x in dew) if dew else float("nan")
        for side in args.sides:
            if side in PEERS_WITHOUT_RUNNER:
                where = venvs.get(side)
                why = "not run (no runner in this suite)" if where else "not installed"
                print(f"| {size} | {side} | {why} | | | |")
                continue
            if not ok[side]:
                print(f"| {size} | {side} | {results[side][0]} | | | |")
                continue
            rate = statistics.median(x[0] for x in ok[side])
            first = statistics.median(x[1] for x in ok[side])
            print(
                f"| {size} | {side} | {rate:,.0f} | {d_rate / rate:.2f}x | {first:.1f} | "
                f"{first / d_first:.2f}x |"
            )


if __name__ == "__main__":
    sys.exit(main())
