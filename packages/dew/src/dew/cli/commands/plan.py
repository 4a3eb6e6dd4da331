"""``dew plan RECIPE``: per-device memory and step FLOPs from compilation; does
it fit a device (exit 4 when not), and ``--recommend``."""

from __future__ import annotations

from dew.cli.exits import EXIT
from dew.cli.loading import add_recipe_arguments, prepared, read_recipe
from dew.cli.output import print_json
from dew.cli.recipe import RecipeError

HELP = "per-device memory and step FLOPs, from compilation (exit 4: does not fit)"


def add_arguments(parser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument(
        "--device-memory",
        help="does it fit a device of this size (e.g. 16GiB); default: the device's own "
        "memory (TPU, GPU) or $DEW_DEVICE_MEMORY",
    )
    parser.add_argument(
        "--recommend",
        action="store_true",
        help="find the fastest remat policy x accumulate that fits the device",
    )


def run(args) -> int:
    """Print the plan of the recipe's step; with a device memory (given, the
    device's own or ``$DEW_DEVICE_MEMORY``) whether it fits (exit 4 when not), and
    with ``--recommend`` the fastest remat policy x accumulate that fits."""
    import dataclasses

    import jax

    from dew.train import plan as compile_plan
    from dew.train import recommend
    from dew.train.memory import device_memory_bytes, parse_bytes

    raw = read_recipe(args.recipe, args.overrides)
    recipe, built = prepared(raw)
    rows = recipe.data.batch
    batch = {
        key: jax.ShapeDtypeStruct((rows, *field.shape), field.dtype)
        for key, field in (built.data.spec or {}).items()
    }
    if not batch:
        raise RecipeError(f"reader {recipe.data.name!r} states no batch spec to plan with")
    try:
        limit = device_memory_bytes(
            built.mesh.make().devices.flat,
            parse_bytes(args.device_memory) if args.device_memory else None,
        )
    except ValueError as error:
        raise RecipeError(f"--device-memory: {error}") from None
    settings = dict(mesh=built.mesh, batch=batch, device_memory_bytes=limit)
    try:
        if args.recommend:
            if limit is None:
                raise RecipeError(
                    "plan --recommend: no device memory known on a CPU; give --device-memory "
                    "(e.g. 16GiB) or set DEW_DEVICE_MEMORY"
                )
            found = recommend(built.objective, built.optimizer, **settings)
        else:
            result = compile_plan(
                built.objective,
                built.optimizer,
                accumulate=recipe.trainer.accumulate,
                update_norm=recipe.trainer.update_norm,
                **settings,
            )
    except ValueError as error:
        raise RecipeError(f"plan: {error}") from None
    if args.recommend:
        overrides = [f"model.config.{k}={v}" for k, v in found.model_settings.items()]
        if found.fits:
            overrides.append(f"trainer.accumulate={found.accumulate}")
        if args.json:
            print_json(
                {
                    "fits": found.fits,
                    "remat_policy": found.remat_policy,
                    "accumulate": found.accumulate,
                    "overrides": overrides,
                    "device_memory_bytes": found.device_memory_bytes,
                    "tried": found.tried,
                    "plan": dataclasses.asdict(found.plan) if found.plan else None,
                }
            )
        else:
            if found.plan is not None:
                print(found.plan)
            print(found)
            if found.fits:
                print(f"  as overrides: {' '.join(overrides)}")
        return EXIT["finished"] if found.fits else EXIT["does_not_fit"]
    fits = result.fits
    if args.json:
        print_json({**dataclasses.asdict(result), "fits": fits})
    else:
        print(result)
        if not fits and fits is not None:
            print(
                "  to fit: a remat policy (model.config), trainer.accumulate, mesh.fsdp; "
                "`dew plan RECIPE --recommend` finds the fastest that fits"
            )
    return EXIT["does_not_fit"] if fits is False else EXIT["finished"]
