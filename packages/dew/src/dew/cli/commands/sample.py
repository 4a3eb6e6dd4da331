"""``dew sample RUN_DIR``: text continued from ``--prompt``, or images of
``--labels`` (PNGs), from the run's newest checkpoint."""

from __future__ import annotations

import os

from dew.cli.exits import EXIT
from dew.cli.output import show_result
from dew.cli.recipe import RecipeError
from dew.cli.trained import trained

HELP = "sample a trained run (EMA weights when kept)"


def add_arguments(parser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", action="append", default=[])
    parser.add_argument("--labels", type=int, nargs="+")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="folder for images (default RUN_DIR/samples)")
    parser.add_argument("--live", action="store_true", help="the live weights, not the EMA")


def run(args) -> int:
    import jax
    import numpy as np

    recipe, built, model, params, averaged = trained(args.run_dir, args.live)
    weights = "EMA" if averaged else "live"
    if args.labels is not None:
        objective = built.objective
        if not hasattr(objective, "sample"):
            raise RecipeError(
                f"--labels: objective {recipe.objective.name!r} does not sample images"
            )
        images = objective.sample(
            {"params": params},
            jax.random.key(args.seed),
            label=np.asarray(args.labels, np.int32),
        )
        try:
            from PIL import Image
        except ImportError:
            raise RecipeError(
                "dew sample --labels writes PNGs with pillow: pip install 'dew-train[images]'"
            ) from None

        out = args.out or os.path.join(args.run_dir, "samples")
        os.makedirs(out, exist_ok=True)
        pixels = np.asarray(images)
        if pixels.dtype != np.uint8:
            pixels = np.clip((pixels + 1) * 127.5, 0, 255).astype(np.uint8)
        paths = []
        for i, (label, image) in enumerate(zip(args.labels, pixels, strict=False)):
            path = os.path.join(out, f"sample_{i:03d}_label_{label}.png")
            Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image).save(path)
            paths.append(path)
        show_result(args, {"images": paths, "weights": weights}, "\n".join(paths))
        return EXIT["finished"]
    if not args.prompt:
        raise RecipeError("dew sample: give --prompt TEXT (a language model) or --labels N ...")
    from dew.sampling import Sampling, generate

    tokenizer = built.tokenizer
    if recipe.objective.name in TOKEN_DIFFUSION:
        texts = _token_diffusion_samples(built.objective, params, args)
        show_result(args, {"samples": texts, "weights": weights}, "\n".join(texts))
        return EXIT["finished"]
    texts = []
    for prompt in args.prompt:
        ids = tokenizer.encode(prompt)
        out = generate(
            model,
            params,
            [ids],
            max_new_tokens=args.max_new_tokens,
            key=jax.random.key(args.seed),
            sampling=Sampling(temperature=args.temperature),
        )
        texts.append(tokenizer.decode(np.asarray(out.tokens[0]).tolist()))
    show_result(args, {"samples": texts, "weights": weights}, "\n".join(texts))
    return EXIT["finished"]


TOKEN_DIFFUSION = ("masked_diffusion", "block_diffusion")


def _token_diffusion_samples(objective, params, args) -> list[str]:
    """Each prompt continued by the objective's own sampler (``objective.export``: a
    :class:`~dew.sampling.token_diffusion.TokenDiffusionGeneration`) to prompt +
    ``--max-new-tokens`` tokens, at most the model's ``max_seq_len`` (for block
    diffusion, whole blocks)."""
    import jax

    block = getattr(objective, "block_size", None) or 1
    longest = objective.model.max_seq_len // block * block
    texts = []
    for i, prompt in enumerate(args.prompt):
        wanted = len(objective.tokenizer.encode(prompt)) + args.max_new_tokens
        length = min(longest, -(-wanted // block) * block)
        pipe = objective.export({"params": params}, length=length)
        texts.append(pipe(prompt, key=jax.random.fold_in(jax.random.key(args.seed), i)))
    return texts
