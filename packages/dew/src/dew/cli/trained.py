"""A trained run read back for ``sample`` and ``export``: its saved recipe built
(without data) and its newest checkpoint's weights."""

from __future__ import annotations

import os

from dew.cli.loading import prepared
from dew.cli.recipe import RecipeError
from dew.cli.run_folder import CHECKPOINTS, check_trusted, is_run, load_run_recipe, not_a_run

__all__ = ["exported", "trained"]


def trained(run_dir: str, live: bool, *, allow_code: bool = False):
    """``(recipe, built, model, params, averaged)`` of a run's newest checkpoint; a
    recipe naming code outside Dew only with ``allow_code``
    (:func:`~dew.cli.run_folder.check_trusted`)."""
    from dew.train import Checkpoints, load_model

    if not is_run(run_dir):
        raise not_a_run(run_dir)
    raw = load_run_recipe(run_dir)
    check_trusted(raw, run_dir, allow_code)
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


def exported(run_dir: str, live: bool, *, allow_code: bool = False):
    """``(pipeline, model, averaged)``: the run's objective's own ``export`` of its newest
    checkpoint's weights (a ``TextGeneration``, ``TokenDiffusionGeneration``,
    ``ClassToImage``, ``FeatureExtractor``, ... whatever the family serves), the LoRA
    adapters folded into the base weights where the model has them."""
    import dataclasses

    from dew.nn.lora import LoRA, fold

    recipe, built, model, params, averaged = trained(run_dir, live, allow_code=allow_code)
    try:
        # load_model gives one trained role's tree as it is (TrainState.params' face)
        roles = [role.name for role in built.objective.roles() if role.trained]
        by_role = {roles[0]: params} if len(roles) == 1 else params
        pipeline = built.objective.export({"params": by_role})
    except NotImplementedError as error:
        raise RecipeError(f"{run_dir}: {error}") from None
    if recipe.model.lora:
        lora = LoRA(**recipe.model.lora)
        pipeline = dataclasses.replace(pipeline, params=fold(pipeline.params, lora))
    return pipeline, model, averaged
