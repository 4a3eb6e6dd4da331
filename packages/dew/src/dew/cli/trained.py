"""A trained run read back for ``sample`` and ``export``: its saved recipe built
(without data) and its newest checkpoint's weights."""

from __future__ import annotations

import os

from dew.cli.loading import prepared
from dew.cli.recipe import RecipeError
from dew.cli.run_folder import CHECKPOINTS, is_run, load_run_recipe, not_a_run

__all__ = ["trained"]


def trained(run_dir: str, live: bool):
    """``(recipe, built, model, params, averaged)`` of a run's newest checkpoint."""
    from dew.train import Checkpoints, load_model

    if not is_run(run_dir):
        raise not_a_run(run_dir)
    raw = load_run_recipe(run_dir)
    directory = os.path.join(run_dir, CHECKPOINTS)
    if not Checkpoints(directory).steps():
        raise RecipeError(f"{run_dir} has no checkpoint yet (train it: dew resume {run_dir})")
    raw["run_dir"] = run_dir
    recipe, built = prepared(raw, with_data=False)
    # load_model's default follows the checkpoint: the EMA weights where the run kept
    # and evaluated with them, as its objective says
    model, params = load_model(directory, averaged=False if live else None)
    objective = built.objective
    averaged = not live and objective.evaluate_averaged and objective.keeps_average
    return recipe, built, model, params, averaged
