"""The peer suite: the seed-size and medium LM trained and greedy-sampled by Dew
and by what a user would pick instead, each side in its own process (and its
own venv), alternating, ratios against Dew printed as a table (goal, issue 15:
Dew >= 1.1x eager torch and >= 1.2x the best JAX peer in training tokens/s,
first step <= 1.2x the hand-written loop's, generation >= 1.5x transformers).

Sides, their runners and interpreters (install lines in each runner's header):

- ``dew``, ``dew_llama``, ``hand``: jax_sides.py in the workspace venv (``.venv``);
- ``torch``: torch_gpt2.py, eager PyTorch + transformers ``generate`` (``/tmp/torchenv``);
- ``tunix``: tunix_side.py (``/work/peers/tunix``);
- ``levanter``: levanter_side.py (``/work/peers/levanter``);
- ``maxtext``: maxtext_side.py (``/work/peers/maxtext``).

A side whose interpreter or runner is missing, or whose run fails, is reported
in the table as such (never dropped). The GPT-2-style sides (hand, torch,
Levanter's Gpt2) are compared with ``dew``; the Llama-style peers (Tunix,
MaxText) with ``dew_llama``, Dew built the same way.

    python tools/bench_peers/run.py --sizes seed medium --repeats 3
    python tools/bench_peers/run.py --sizes seed --venv tunix=/opt/tunix/bin/python
    python tools/bench_peers/run.py --write docs/performance.md

Tunix runs on jax 0.12 (Python 3.12); so does Dew for a user on Python 3.12+ (the
lock forks on Python). For Dew on the same jax, give its sides a Python 3.13 venv of
the workspace (``UV_PROJECT_ENVIRONMENT=/work/venv313 uv sync --locked --all-packages
--all-extras -p 3.13``): ``--venv dew=/work/venv313/bin/python
dew_llama=/work/venv313/bin/python hand=/work/venv313/bin/python``.

Definitions (tools/bench_peers/protocol.py), the same for every side:
tokens/s after the first step (steps 2..N), time to the first step from
process start, greedy generation new tokens/s of a warm call, peak RSS. Each
figure is the median over repeats; the load average is printed with the table
(the machine may be shared: read ratios with it). Before each timed run the side's
runner is started with ``--help`` once, untimed, so its imports come from the page
cache. "Dew / side by round" pairs the
training rates of each round (the two runs minutes apart) and gives their median
and each round's: on a machine whose speed drifts between rounds it is the
steadier ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
SIZES = ("seed", "medium")
# steps per run: enough that steps 2..N take seconds at each size (60 at seed, ~0.6 s of
# steps, swung by 40% run to run on a shared VM; 300 take ~3 s)
DEFAULT_STEPS = {"seed": 300, "medium": 10}
# side: (runner, default interpreter, the Dew side it is compared with)
SIDES = {
    "dew": ("jax_sides.py", str(ROOT / ".venv/bin/python"), "dew"),
    "dew_llama": ("jax_sides.py", str(ROOT / ".venv/bin/python"), "dew_llama"),
    "hand": ("jax_sides.py", str(ROOT / ".venv/bin/python"), "dew"),
    "torch": ("torch_gpt2.py", "/tmp/torchenv/bin/python", "dew"),
    "tunix": ("tunix_side.py", "/work/peers/tunix/bin/python", "dew_llama"),
    "levanter": ("levanter_side.py", "/work/peers/levanter/bin/python", "dew"),
    "maxtext": ("maxtext_side.py", "/work/peers/maxtext/bin/python", "dew_llama"),
}
BEGIN, END = "<!-- bench_peers:begin -->", "<!-- bench_peers:end -->"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: an unknown size or side, or a ``--venv`` path
    that does not exist, stops with a message naming it and the accepted values."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--sides", nargs="+", default=list(SIDES))
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps per run (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--venv", nargs="*", default=[], metavar="SIDE=PYTHON")
    parser.add_argument("--write", metavar="MARKDOWN", help="replace the table in this file")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per side run")
    args = parser.parse_args(argv)
    for size in args.sizes:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; use one of {list(SIZES)}")
    for side in args.sides:
        if side not in SIDES:
            parser.error(f"unknown side {side!r}; use one of {list(SIDES)}")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (tokens/s is over steps 2..N)")
    args.pythons = {side: python for side, (_, python, _) in SIDES.items()}
    for pair in args.venv:
        side, _, path = pair.partition("=")
        if side not in SIDES or not path:
            parser.error(f"--venv {pair!r}: use SIDE=PYTHON with SIDE one of {list(SIDES)}")
        if not os.path.exists(path):
            parser.error(
                f"--venv {pair!r}: no interpreter at {path!r}; install the peer there "
                f"(see the header of tools/bench_peers/{SIDES[side][0]}) or pass its python"
            )
        args.pythons[side] = path
    return args


def run_side(side: str, python: str, size: str, steps: int, timeout: float) -> dict | str:
    """The side's ``RESULT`` dict, or a string saying why there is none."""
    runner = HERE / SIDES[side][0]
    if not os.path.exists(python):
        return f"not installed (no {python}; see {runner.name})"
    if not runner.exists():
        return f"no runner ({runner.name})"
    args = [python, str(runner), "--size", size, "--steps", str(steps)]
    if runner.name == "jax_sides.py":
        args += ["--side", side]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # one CPU device for every JAX side
    env.pop("VIRTUAL_ENV", None)
    try:
        # Imports read from the page cache, as on a machine that ran the side before: a
        # runner's --help imports its modules and stops. Without it the time to the
        # first step measured whether the host had evicted that venv's files (a cold
        # cache added 8.7 s to Dew's imports, 10.3 s against 1.6 s; the side run just
        # before decides it, and the order rotates).
        subprocess.run(
            [python, str(runner), "--help"], capture_output=True, env=env, cwd=ROOT,
            timeout=timeout,
        )  # fmt: skip
        done = subprocess.run(
            args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = " ".join(done.stderr.strip().splitlines()[-1:])[-160:]
    return f"failed (rc {done.returncode}): {tail}"


def median(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def table(size: str, results: dict[str, list]) -> list[str]:
    lines = []
    for side, runs in results.items():
        ok = [r for r in runs if isinstance(r, dict)]
        if not ok:
            why = str(runs[0]).replace("|", "/") if runs else "not run"
            lines.append(f"| {size} | {side} | {why} | | | | | | | |")
            continue
        ref = [r for r in results.get(SIDES[side][2], []) if isinstance(r, dict)]
        rate, first, gen = (median(ok, k) for k in ("tokens_per_s", "first_step_s",
                                                      "gen_tokens_per_s"))  # fmt: skip
        rss = median(ok, "peak_rss_mib")
        rounds = ""
        if ref and side != SIDES[side][2]:
            ratios = (
                f"{median(ref, 'tokens_per_s') / rate:.2f}x",
                f"{first / median(ref, 'first_step_s'):.2f}x",
                f"{median(ref, 'gen_tokens_per_s') / gen:.2f}x",
            )
            paired = paired_ratios(results[SIDES[side][2]], runs)
            if paired:
                rounds = (
                    f"{statistics.median(paired):.2f}x ({', '.join(f'{x:.2f}' for x in paired)})"
                )
        else:
            ratios = ("(ref)", "(ref)", "(ref)")
        note = ok[0].get("note") or ""
        shown_gen = f"{gen:,.0f}" if gen == gen else "not measured"
        if gen != gen:  # NaN: the side has no generation to time
            ratios = (*ratios[:2], "")
        lines.append(
            f"| {size} | {side} | {rate:,.0f} | {ratios[0]} | {rounds} | {first:.1f} | "
            f"{ratios[1]} | {shown_gen} | {ratios[2]} | {rss:,.0f} | {note}".rstrip()
            + " |"
        )
    return lines


def paired_ratios(reference: list, runs: list) -> list[float]:
    """Training tokens/s of the Dew side over the side's, round by round (both ran in
    the same round, minutes apart): steadier than the ratio of medians when the
    machine's speed drifts between rounds. Rounds where either run failed are left out."""
    return [
        d["tokens_per_s"] / o["tokens_per_s"]
        for d, o in zip(reference, runs)
        if isinstance(d, dict) and isinstance(o, dict)
    ]


def write(path: str, text: str) -> None:
    doc = pathlib.Path(path)
    body = doc.read_text()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in body and END in body:
        body = body[: body.index(BEGIN)] + block + body[body.index(END) + len(END) :]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(body)


def main(argv=None) -> None:
    args = parse_args(argv)
    load = [os.getloadavg()]
    used: dict[str, int] = {}
    lines = [
        "| size | side | tokens/s | Dew / side | Dew / side by round | first step s | "
        "side / Dew | generate tok/s | Dew / side | peak RSS MiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in args.sizes:
        results: dict[str, list] = {side: [] for side in args.sides}
        missing: set[str] = set()  # not installed / no runner: nothing to repeat
        steps = args.steps or DEFAULT_STEPS[size]
        used[size] = steps
        for r in range(args.repeats):
            order = args.sides[r % len(args.sides) :] + args.sides[: r % len(args.sides)]
            for side in order:
                if side in missing:
                    continue
                begin = time.perf_counter()
                out = run_side(side, args.pythons[side], size, steps, args.timeout)
                results[side].append(out)
                shown = f"{out['tokens_per_s']:,.0f} tokens/s" if isinstance(out, dict) else out
                print(f"  {size} {side} #{r + 1}: {shown} ({time.perf_counter() - begin:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
                load.append(os.getloadavg())
                if isinstance(out, str) and out.startswith(("not installed", "no runner")):
                    missing.add(side)
        lines += table(size, results)
    one = [x[0] for x in load]
    lines.append(
        f"\n{', '.join(f'{n} steps per run at {k}' for k, n in used.items())}; "
        f"median of {args.repeats} alternating runs per side; "
        f"1-minute load average {min(one):.1f}-{max(one):.1f} during the run on "
        f"{os.cpu_count()} cores."
    )
    text = "\n".join(lines)
    print(text)
    if args.write:
        write(args.write, text)


if __name__ == "__main__":
    sys.exit(main())
