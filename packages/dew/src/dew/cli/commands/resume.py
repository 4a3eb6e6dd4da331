"""``dew resume RUN_DIR [key=value ...]``: continue a run from its saved recipe.

Only settings that cannot change what the run trains step by step may differ
(:data:`RESUMABLE`: the steps, the cadences, checkpoint retention, trackers, the
compilation cache, and the schedule's ``decay_steps`` when given explicitly); the
run's ``recipe.yaml`` stays as written at its start and each resume appends what it
changed to ``resumes.yaml``."""

from __future__ import annotations

import sys

from dew.cli.cluster import initialize_distributed
from dew.cli.commands.train import add_cluster_arguments, owned_run
from dew.cli.recipe import RecipeError, apply_overrides, flatten
from dew.cli.run_folder import (
    RESUMABLE,
    add_allow_code,
    check_trusted,
    is_run,
    load_run_recipe,
    not_a_run,
)

HELP = "continue a run from its saved recipe"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    add_cluster_arguments(parser)
    add_allow_code(parser)


def run(args) -> int:
    if not is_run(args.run_dir):
        raise not_a_run(args.run_dir)
    initialize_distributed(args)
    saved = load_run_recipe(args.run_dir)
    check_trusted(saved, args.run_dir, args.allow_recipe_code)
    raw = apply_overrides(saved, [])  # a copy
    raw["run_dir"] = args.run_dir
    _keep_decay(raw)
    changed = apply_overrides(raw, args.overrides)
    before, after = flatten(saved), flatten(changed)
    differs = {
        k: after.get(k)
        for k in {**before, **after}
        if k != "run_dir" and before.get(k, _ABSENT) != after.get(k, _ABSENT)
    }
    refused = [k for k in differs if not k.startswith(RESUMABLE)]
    if refused:
        shown = "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in refused)
        raise RecipeError(
            f"{args.run_dir}: a resume changes only what cannot alter the steps already "
            f"trained ({', '.join(RESUMABLE)}); not {shown}. Nothing was changed: for a "
            f"run with these settings, `dew train RECIPE run_dir=NEW_DIR`"
        )
    schedule = changed.get("optimizer", {}).get("schedule", {})
    if changed["trainer"]["steps"] != raw["trainer"]["steps"] and schedule.get("decay_steps"):
        kept = schedule["decay_steps"] == raw["optimizer"]["schedule"]["decay_steps"]
        print(
            f"dew: trainer.steps {raw['trainer']['steps']} -> {changed['trainer']['steps']}; "
            f"the learning-rate schedule decays over {schedule['decay_steps']} steps"
            + (
                " as trained (optimizer.schedule.decay_steps=N changes it)"
                if kept
                else " (optimizer.schedule.decay_steps as given)"
            ),
            file=sys.stderr,
        )
    return owned_run(changed, args, resumed=differs)


_ABSENT = object()


def _keep_decay(raw: dict) -> None:
    """A saved recipe of an earlier Dew whose decaying schedule left ``decay_steps``
    to ``trainer.steps``: the steps it was trained with, made explicit."""
    from dew.cli.build import DECAYING

    schedule = raw.get("optimizer", {}).get("schedule")
    if isinstance(schedule, dict) and schedule.get("name") in DECAYING:
        if not schedule.get("decay_steps"):
            schedule["decay_steps"] = raw.get("trainer", {}).get("steps")
