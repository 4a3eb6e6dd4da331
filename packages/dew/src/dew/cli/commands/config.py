"""``dew config RECIPE [key=value ...]`` (also ``dew train RECIPE --print-config``):
the recipe as ``dew train`` would run it, every default filled in (the model's
config, the objective's and the reader's arguments, the schedule's ``decay_steps``,
the run folder), printed as YAML; nothing is written and nothing trains."""

from __future__ import annotations

import yaml

from dew.cli.exits import EXIT
from dew.cli.loading import add_recipe_arguments, prepared, read_recipe, with_run_dir
from dew.cli.output import print_json

HELP = "print the resolved recipe (every default filled in) and exit"


def add_arguments(parser) -> None:
    add_recipe_arguments(parser)


def run(args) -> int:
    raw = with_run_dir(read_recipe(args.recipe, args.overrides), args.recipe)
    _, built = prepared(raw)
    if args.json:
        print_json(built.resolved)
    else:
        print(yaml.safe_dump(built.resolved, sort_keys=False), end="")
    return EXIT["finished"]
