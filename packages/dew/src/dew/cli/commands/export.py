"""``dew export RUN_DIR --to dew|hf|diffusers OUT``: the run's model as a checkpoint
directory, written by the pipeline its objective exports (``objective.export``):
``dew`` is Dew's own format (weights, config, tokenizer and the pipeline's sampling
settings); ``hf`` and ``diffusers`` the Hugging Face (transformers or diffusers)
family of the model: the one its pretrained source had, else the first family
``dew.nn.hf`` registers for the model (``llama`` for a causal transformer, ``dit``
for a DiT)."""

from __future__ import annotations

import os

from dew.cli.exits import EXIT
from dew.cli.output import show_result
from dew.cli.recipe import RecipeError
from dew.cli.run_folder import add_allow_code, is_run, lock_run, release_run
from dew.cli.trained import exported

HELP = "write the run's model as a checkpoint directory (its objective's own export)"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--to", choices=("hf", "diffusers", "dew"), default="dew")
    parser.add_argument("out")
    parser.add_argument("--live", action="store_true", help="the live weights, not the EMA")
    add_allow_code(parser)


def run(args) -> int:
    """Into a run folder (``OUT`` inside one), under that run's lock: refused while
    another process trains it, and no other writer starts until it is written."""
    owner = run_containing(args.out)
    if owner is None:
        return _export(args)
    lock_run(owner)
    try:
        return _export(args)
    finally:
        release_run(owner)


def run_containing(path: str) -> str | None:
    """The run folder ``path`` lies in (it or a parent holds ``recipe.yaml``)."""
    folder = os.path.abspath(path)
    while True:
        if is_run(folder):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _export(args) -> int:
    pipeline, model, averaged = exported(args.run_dir, args.live, allow_code=args.allow_recipe_code)
    fmt = "dew" if args.to == "dew" else hugging_face_family(args.run_dir, model, args.to)
    try:
        path = pipeline.save(args.out) if fmt == "dew" else pipeline.save(args.out, format=fmt)
    except (ValueError, TypeError) as error:
        said = str(error).replace("format='dew'", "--to dew")
        if "unexpected keyword argument 'format'" in said:
            said = f"{type(pipeline).__name__} is written in Dew's format only; use --to dew"
        raise RecipeError(f"export --to {args.to}: {said}") from None
    show_result(args, {"path": str(path), "format": fmt, "averaged": averaged}, str(path))
    return EXIT["finished"]


def hugging_face_family(run_dir: str, model, to: str) -> str:
    """The family a pretrained run came from (the ``config.json`` of the saved
    recipe's ``model.pretrained``), else the first registered one whose Dew model
    is the run's (for ``--to diffusers``, of the diffusers library: the formats'
    ``library``, read as ``dew.nn.hf`` reads it)."""
    from dew.cli.run_folder import load_run_recipe
    from dew.nn import hf, models
    from dew.nn.lora import base_module

    source = load_run_recipe(run_dir).get("model", {}).get("pretrained")
    if source and os.path.exists(os.path.join(source, "config.json")):
        import json

        with open(os.path.join(source, "config.json")) as f:
            return hf.family_of(json.load(f), source)
    name = models.config_of(base_module(model))[0]
    families = [f for f in hf.names() if hf.get(f).registry_name == name]
    if to == "diffusers":
        families = [f for f in families if getattr(hf.get(f), "library", "") == "diffusers"]
    if not families:
        raise RecipeError(
            f"no {'diffusers' if to == 'diffusers' else 'Hugging Face'} family holds a "
            f"{name!r} model (dew.nn.hf: {', '.join(hf.names())}); use --to dew"
        )
    return families[0]
