"""The ``dew`` command: train, resume, plan, list, sample, export and report
runs from one recipe file (docs/command-line.md).

    dew train RECIPE [key=value ...]     a new run, or continue the one in its run_dir
    dew resume RUN_DIR [key=value ...]   continue from the run's saved recipe
    dew plan RECIPE [key=value ...] [--device-memory 80GiB] [--recommend]
    dew runs [DIR]
    dew sample RUN_DIR --prompt TEXT | --labels 0 1 2
    dew export RUN_DIR --to hf|diffusers|dew OUT
    dew report RUN_DIR
    dew launch --processes N RECIPE [key=value ...]

Exit codes (:data:`EXIT`): 0 finished, 75 preempted and checkpointed (SIGTERM,
EX_TEMPFAIL: requeue and rerun the same command), 2 bad configuration, 3 stopped
by non-finite steps, 4 does not fit the device's memory (``plan``, or ``train``
refused before its first step), 1 any other failure. Errors print one line without a
traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["EXIT", "entry", "main"]

EXIT = {
    "finished": 0,
    "failed": 1,
    "bad_config": 2,
    "non_finite": 3,
    "does_not_fit": 4,
    "preempted": 75,
}


_GLOBAL = ("--debug", "--quiet", "--json")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dew", description="Train, resume, plan, list, sample and export Dew runs."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--quiet", action="store_true", help="print only errors and results")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per log step (or result) on stdout"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_cluster(p):
        p.add_argument("--coordinator", help="jax.distributed coordinator host:port")
        p.add_argument("--num-processes", type=int)
        p.add_argument("--process-id", type=int)

    train = sub.add_parser("train", help="train from a recipe (continues its run_dir)")
    train.add_argument("recipe")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    with_cluster(train)
    resume = sub.add_parser("resume", help="continue a run from its saved recipe")
    resume.add_argument("run_dir")
    resume.add_argument("overrides", nargs="*", metavar="key=value")
    with_cluster(resume)
    plan = sub.add_parser("plan", help="per-device memory and step FLOPs, from compilation")
    plan.add_argument("recipe")
    plan.add_argument("overrides", nargs="*", metavar="key=value")
    plan.add_argument(
        "--device-memory",
        help="does it fit a device of this size (e.g. 16GiB); default: the device's own "
        "memory (TPU, GPU) or $DEW_DEVICE_MEMORY",
    )
    plan.add_argument(
        "--recommend",
        action="store_true",
        help="find the fastest remat policy x accumulate that fits the device",
    )
    runs = sub.add_parser("runs", help="list the runs under a directory")
    runs.add_argument("directory", nargs="?", default="runs")
    sample = sub.add_parser("sample", help="sample a trained run (EMA weights when kept)")
    sample.add_argument("run_dir")
    sample.add_argument("--prompt", action="append", default=[])
    sample.add_argument("--labels", type=int, nargs="+")
    sample.add_argument("--max-new-tokens", type=int, default=32)
    sample.add_argument("--temperature", type=float, default=0.0)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--out", help="folder for images (default RUN_DIR/samples)")
    sample.add_argument("--live", action="store_true", help="the live weights, not the EMA")
    export = sub.add_parser("export", help="write the run's model as a checkpoint directory")
    export.add_argument("run_dir")
    export.add_argument("--to", choices=("hf", "diffusers", "dew"), default="dew")
    export.add_argument("out")
    export.add_argument("--live", action="store_true", help="the live weights, not the EMA")
    report = sub.add_parser("report", help="an HTML page of the run's curves and previews")
    report.add_argument("run_dir")
    report.add_argument("--out", help="default RUN_DIR/report.html")
    launch = sub.add_parser("launch", help="run `dew train` as N local processes")
    launch.add_argument("--processes", type=int, required=True)
    launch.add_argument("--devices-per-process", type=int, default=0)
    launch.add_argument("recipe")
    launch.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (:data:`EXIT`)."""
    from dew.cli.recipe import RecipeError

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in argv if a in _GLOBAL]  # accepted anywhere on the line
    args = _parser().parse_args(flags + [a for a in argv if a not in _GLOBAL])
    try:
        return _dispatch(args)
    except RecipeError as error:
        if args.debug:
            raise
        print(f"dew {args.command}: {_one_line(error)}", file=sys.stderr)
        return EXIT["bad_config"]
    except KeyboardInterrupt:
        return EXIT["preempted"]
    except Exception as error:  # one line, the code a scheduler can act on
        if args.debug:
            raise
        from dew.cli import commands

        code = commands.exit_code_of(error)
        print(f"dew {args.command}: {type(error).__name__}: {_one_line(error)}", file=sys.stderr)
        return code


def _one_line(error: BaseException) -> str:
    """The message on one line (jsonargparse's span several)."""
    return " ".join(str(error).split())


def _dispatch(args) -> int:
    from dew.cli import commands

    return getattr(commands, args.command)(args)


def entry() -> None:
    """The console script."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())


def print_json(value) -> None:
    print(json.dumps(value, default=str), flush=True)
