"""The ``dew`` command: train, resume, plan, list, sample, export and report
runs from one recipe file (docs/command-line.md).

    dew train RECIPE [key=value ...]     a new run (runs/NAME, runs/NAME-2, ...), or
                                         the same recipe continued in its run_dir
    dew config RECIPE [key=value ...]    the resolved recipe, every default filled in
    dew resume RUN_DIR [key=value ...]   continue from the run's saved recipe
    dew plan RECIPE [key=value ...] [--device-memory 80GiB] [--recommend]
    dew runs [DIR]
    dew sample RUN_DIR --prompt TEXT | --labels 0 1 2
    dew export RUN_DIR --to hf|diffusers|dew OUT
    dew report RUN_DIR
    dew launch --processes N RECIPE [key=value ...]

Each subcommand is one module of :mod:`dew.cli.commands` (its table:
:data:`dew.cli.commands.COMMANDS`).

Exit codes (:data:`EXIT`): 0 finished, 75 preempted and checkpointed (SIGTERM,
EX_TEMPFAIL: requeue and rerun the same command), 2 bad configuration, 3 stopped
by non-finite steps, 4 does not fit the device's memory (``plan``, or ``train``
refused before its first step), 1 any other failure. Errors print one line without a
traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import os
import sys

from dew.cli.exits import EXIT

__all__ = ["EXIT", "entry", "main"]

_GLOBAL = ("--debug", "--quiet", "--json")

EXIT_CODES = """exit codes: 0 finished, 1 other failure, 2 bad configuration (nothing changed),
  3 stopped by non-finite steps, 4 does not fit the device's memory (plan, or train
  before its first step), 75 preempted and checkpointed (rerun the same command)
"""

EXAMPLES = """examples:
  dew train recipes/lm_scratch.yaml trainer.steps=50 optimizer.learning_rate=1e-3
  dew resume runs/lm_scratch trainer.steps=400
  dew config recipes/lm_scratch.yaml model.config.num_layers=1
"""


def _parser() -> argparse.ArgumentParser:
    from dew.cli.commands import COMMANDS, command
    from dew.cli.recipe import recipe_help

    keys = recipe_help()
    parser = argparse.ArgumentParser(
        prog="dew",
        description="Train, resume, plan, list, sample and export Dew runs.",
        epilog=f"{keys}\n{EXAMPLES}\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--quiet", action="store_true", help="print only errors and results")
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per log step (or result) on stdout"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = command(name)
        takes_recipe = name in ("train", "config", "plan", "resume", "launch")
        module.add_arguments(
            sub.add_parser(
                name,
                help=module.HELP,
                description=module.__doc__.replace("``", "`"),
                epilog=f"{keys}\n{EXAMPLES}" if takes_recipe else None,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit code (:data:`EXIT`)."""
    from dew.cli.commands import command
    from dew.cli.exits import exit_code_of
    from dew.cli.recipe import RecipeError

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in argv if a in _GLOBAL]  # accepted anywhere on the line
    args = _parser().parse_args(flags + [a for a in argv if a not in _GLOBAL])
    try:
        return command(args.command).run(args)
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
        print(f"dew {args.command}: {type(error).__name__}: {_one_line(error)}", file=sys.stderr)
        return exit_code_of(error)


def _one_line(error: BaseException) -> str:
    """The message on one line (jsonargparse's span several)."""
    return " ".join(str(error).split())


def entry() -> None:
    """The console script."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
