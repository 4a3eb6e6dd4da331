"""``dew export RUN_DIR --to hf|diffusers|dew OUT``: the run's model as a
checkpoint directory."""

from __future__ import annotations

from dew.cli.exits import EXIT
from dew.cli.output import show_result
from dew.cli.recipe import RecipeError
from dew.cli.trained import trained

HELP = "write the run's model as a checkpoint directory"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--to", choices=("hf", "diffusers", "dew"), default="dew")
    parser.add_argument("out")
    parser.add_argument("--live", action="store_true", help="the live weights, not the EMA")


def run(args) -> int:
    import dataclasses

    from dew.sampling import Pretrained

    recipe, built, model, params, averaged = trained(args.run_dir, args.live)
    formats = {"dew": "dew", "diffusers": "dit"}  # diffusers' DiT (dew.nn.hf "dit")
    if args.to == "hf":
        from dew.nn import models

        name = models.config_of(model)[0] if not recipe.model.pretrained else None
        fmt = {"causal_transformer": "llama", "dit": "dit"}.get(name, "llama")
        if recipe.model.pretrained:
            fmt = Pretrained.load(recipe.model.pretrained).format
    else:
        fmt = formats[args.to]
    pretrained = Pretrained(model=model, params=params, tokenizer=built.tokenizer)
    if recipe.model.lora:
        from dew.nn.lora import LoRA

        pretrained = dataclasses.replace(pretrained, lora=LoRA(**recipe.model.lora))
    try:
        path = pretrained.save(args.out, format=fmt)
    except (ValueError, TypeError) as error:
        raise RecipeError(f"export --to {args.to}: {error}") from None
    show_result(args, {"path": str(path), "format": fmt, "averaged": averaged}, str(path))
    return EXIT["finished"]
