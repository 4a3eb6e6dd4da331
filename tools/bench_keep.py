"""Before and after in one run: each family's hand-loop benchmark under two source
trees, in alternating processes, so a change to the trainer is measured against
the code it replaced on the same machine at the same time.

Each benchmark is run from its own tree (``TREE/tools/...``) with that tree's
packages first on ``PYTHONPATH`` (``TREE/packages/*/src``), under the same
interpreter and installed dependencies. The rounds alternate the order (before,
after; after, before; ...). Every line the two trees' runs print in the same
shape (the text with its numbers blanked) is printed once with each number as
the median over the rounds, ``before -> after`` where they differ. The ratios
each benchmark prints (Dew against its hand-written loop, or the peer suite's
Dew against hand) are what to read; absolute times move with the machine.

    git worktree add --detach /tmp/before 3fed1e3      # the trainer before the reshape
    python tools/bench_keep.py --before /tmp/before --rounds 2
    python tools/bench_keep.py --before /tmp/before --benches dpo jepa --rounds 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> the benchmark's command line (relative to the tree's tools/), at sizes that
# run in a minute or two each on 2 cores
BENCHES = {
    "train": ["bench_train.py", "--sizes", "seed", "medium", "--steps", "30", "--repeats", "3"],
    "peers": [
        "bench_peers/run.py",
        "--sizes",
        "seed",
        "medium",
        "--sides",
        "dew",
        "dew_llama",
        "hand",
        "--repeats",
        "2",
    ],
    "dpo": ["bench_dpo.py", "--size", "small", "--steps", "30", "--repeats", "3"],
    "grpo": ["bench_grpo.py", "--size", "small", "--iterations", "6", "--repeats", "3"],
    "diffusion": ["bench_diffusion.py", "--parts", "train", "loop", "--repeats", "3"],
    "jepa": ["bench_jepa.py", "--parts", "train", "--repeats", "3"],
}
# a number, thousands grouped with commas or not ("52,565.5" is one number)
NUMBER = re.compile(r"(?<![\w.,])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?%?")


def tree_env(tree: pathlib.Path) -> dict[str, str]:
    """The environment that puts ``tree``'s packages first on the import path."""
    sources = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    if not sources:
        raise SystemExit(f"{tree} has no packages/*/src: pass a checkout of this repository")
    env = dict(os.environ)
    # before whatever the environment already names (the tree must win over an
    # installed Dew; an interpreter's own folders stay reachable)
    env["PYTHONPATH"] = os.pathsep.join(
        [*sources, str(tree / "tools"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_once(tree: pathlib.Path, argv: list[str], timeout: float) -> str:
    script, *args = argv
    if script == "bench_peers/run.py":
        # the peer suite's JAX sides in this interpreter (with the tree's PYTHONPATH)
        args += ["--venv", *(f"{s}={sys.executable}" for s in ("dew", "dew_llama", "hand"))]
    done = subprocess.run(
        [sys.executable, str(tree / "tools" / script), *args],
        cwd=tree,
        env=tree_env(tree),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        return f"FAILED (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}\n"
    return done.stdout


def shape(line: str) -> str:
    return NUMBER.sub("#", line.rstrip())


def numbers(line: str) -> list[float]:
    return [float(m.rstrip("%").replace(",", "")) for m in NUMBER.findall(line)]


def merge(before: list[str], after: list[str]) -> list[str]:
    """The lines both sides printed in the same shape, numbers as medians over the
    runs, ``b -> a`` where they differ; then what only one side printed."""

    def by_shape(outputs):
        table: dict[str, list[list[float]]] = {}
        order = []
        for out in outputs:
            for line in out.splitlines():
                if not line.strip():
                    continue
                key = shape(line)
                if key not in table:
                    order.append(key)
                table.setdefault(key, []).append(numbers(line))
        return order, table

    order, b = by_shape(before)
    _, a = by_shape(after)
    lines = []
    for key in order:
        if key not in a:
            continue
        cols_b = [statistics.median(c) for c in zip(*b[key])] if b[key][0] else []
        cols_a = [statistics.median(c) for c in zip(*a[key])] if a[key][0] else []
        parts = key.split("#")
        text = parts[0]
        for i, rest in enumerate(parts[1:]):
            x, y = cols_b[i], cols_a[i]
            text += f"{x:g}" if x == y else f"{x:g} -> {y:g}"
            text += rest
        lines.append(text)
    only = [f"  (before only) {k}" for k in order if k not in a]
    only += [f"  (after only) {k}" for k in a if k not in b]
    return lines + only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=pathlib.Path, help="a checkout")
    parser.add_argument("--after", type=pathlib.Path, default=ROOT, help="default: this one")
    parser.add_argument("--benches", nargs="+", default=list(BENCHES), choices=list(BENCHES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument(
        "--args", help="replace the benchmark's arguments (one --benches name), e.g. '--sizes seed'"
    )
    parser.add_argument(
        "--first", choices=["before", "after"], default="before", help="the side of round 1"
    )
    parser.add_argument("--raw", type=pathlib.Path, help="also write each run's output here")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.args is not None:
        if len(args.benches) != 1:
            parser.error("--args needs exactly one --benches name")
        BENCHES[args.benches[0]] = [BENCHES[args.benches[0]][0], *args.args.split()]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        tree_env(tree)  # checks the layout before anything runs
        rev = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        if not rev and (tree / "REVISION").exists():  # a copied tree names its commit
            rev = (tree / "REVISION").read_text().strip()
        print(f"{name}: {tree} ({rev or 'not a git checkout'})")
    for bench in args.benches:
        outputs = {"before": [], "after": []}
        loads = []
        for r in range(args.rounds):
            order = (
                ["before", "after"]
                if (r % 2 == 0) == (args.first == "before")
                else ["after", "before"]
            )
            for side in order:
                loads.append(os.getloadavg()[0])
                start = time.perf_counter()
                out = run_once(trees[side], BENCHES[bench], args.timeout)
                outputs[side].append(out)
                if args.raw:
                    args.raw.mkdir(parents=True, exist_ok=True)
                    (args.raw / f"{bench}-{args.first}-{r + 1}-{side}.txt").write_text(out)
                print(f"  [{bench} round {r + 1} {side}: {time.perf_counter() - start:.0f} s]")
                sys.stdout.flush()
        print(f"\n== {bench}: {' '.join(BENCHES[bench])}, {args.rounds} rounds, load {loads}")
        print("\n".join(merge(outputs["before"], outputs["after"])))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
