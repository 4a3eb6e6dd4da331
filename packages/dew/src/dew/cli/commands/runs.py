"""``dew runs [DIR]``: the runs under a directory, one line (or JSON object) each."""

from __future__ import annotations

import os

from dew.cli.exits import EXIT
from dew.cli.output import print_json
from dew.cli.recipe import RecipeError
from dew.cli.run_folder import is_run, run_summary

HELP = "list the runs under a directory"


def add_arguments(parser) -> None:
    parser.add_argument("directory", nargs="?", default="runs")


def run(args) -> int:
    directory = args.directory
    if is_run(directory):
        found = [directory]
    elif os.path.isdir(directory):
        found = sorted(
            os.path.join(directory, d)
            for d in os.listdir(directory)
            if is_run(os.path.join(directory, d))
        )
    else:
        raise RecipeError(f"{directory} is not a directory of runs")
    summaries = [run_summary(d) for d in found]
    if args.json:
        for summary in summaries:
            print_json(summary)
        return EXIT["finished"]
    if not summaries:
        print(f"no Dew runs under {directory}")
    for s in summaries:
        loss = "-" if s["loss"] is None else f"{s['loss']:.4g}"
        evals = ", ".join(
            f"{k} {v:.4g}" for k, v in s["eval"].items() if isinstance(v, int | float)
        )
        total = f"/{s['steps']}" if s["steps"] else ""
        print(
            f"{s['run_dir']}: {s['status']}, step {s['step']}{total}, loss {loss}"
            + (f", eval {evals}" if evals else "")
            + f", checkpoints {s['checkpoints'] or 'none'}"
        )
    return EXIT["finished"]
