"""``dew report RUN_DIR``: an HTML page of the run's curves and previews
(:mod:`dew.cli.report`)."""

from __future__ import annotations

from dew.cli.exits import EXIT
from dew.cli.output import show_result
from dew.cli.run_folder import is_run, not_a_run

HELP = "an HTML page of the run's curves and previews"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--out", help="default RUN_DIR/report.html")


def run(args) -> int:
    from dew.cli.report import write_report

    if not is_run(args.run_dir):
        raise not_a_run(args.run_dir)
    path = write_report(args.run_dir, args.out)
    show_result(args, {"report": path}, path)
    return EXIT["finished"]
