"""``dew sample RUN_DIR``: text continued from ``--prompt``, or images of
``--labels`` (PNGs), from the run's newest checkpoint."""

from __future__ import annotations

import os

from dew.cli.exits import EXIT
from dew.cli.output import show_result
from dew.cli.recipe import RecipeError
from dew.cli.run_folder import add_allow_code
from dew.cli.trained import exported

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
    add_allow_code(parser)


def run(args) -> int:
    """The pipeline the run's objective exports, by what it takes: text
    (``TextGeneration``: causal decoding; ``TokenDiffusionGeneration``: the
    family's own denoising sampler) or class labels (``ClassToImage``)."""
    from dew.sampling import ClassToImage, TextGeneration, TokenDiffusionGeneration

    pipeline, _, averaged = exported(args.run_dir, args.live, allow_code=args.allow_recipe_code)
    weights = "EMA" if averaged else "live"
    takes = {TextGeneration: "--prompt", TokenDiffusionGeneration: "--prompt"}
    takes[ClassToImage] = "--labels"
    wanted = next((flag for cls, flag in takes.items() if isinstance(pipeline, cls)), None)
    if wanted is None:
        raise RecipeError(
            f"{args.run_dir}: its objective exports a {type(pipeline).__name__}, which "
            f"does not sample (dew sample takes text or class-to-image pipelines); "
            f"write it with dew export"
        )
    given = "--labels" if args.labels is not None else "--prompt" if args.prompt else None
    if given != wanted:
        raise RecipeError(
            f"{args.run_dir}: its objective exports a {type(pipeline).__name__}; give "
            + ("--prompt TEXT" if wanted == "--prompt" else "--labels N [N ...]")
            + (f", not {given}" if given else "")
        )
    if wanted == "--labels":
        paths = _images(pipeline, args)
        show_result(args, {"images": paths, "weights": weights}, "\n".join(paths))
        return EXIT["finished"]
    if isinstance(pipeline, TokenDiffusionGeneration):
        texts = _token_diffusion_samples(pipeline, args)
    else:
        texts = _continued(pipeline, args)
    show_result(args, {"samples": texts, "weights": weights}, "\n".join(texts))
    return EXIT["finished"]


def _continued(pipeline, args) -> list[str]:
    import jax

    from dew.sampling import Sampling

    sampling = Sampling(temperature=args.temperature)
    return [
        pipeline(
            prompt,
            max_new_tokens=args.max_new_tokens,
            key=jax.random.key(args.seed),
            sampling=sampling,
        )
        for prompt in args.prompt
    ]


def _token_diffusion_samples(pipeline, args) -> list[str]:
    """Each prompt continued to prompt + ``--max-new-tokens`` tokens, at most the
    model's ``max_seq_len`` (for block diffusion, whole blocks)."""
    import dataclasses

    import jax

    block = pipeline.block_size or 1
    longest = pipeline.model.max_seq_len // block * block
    texts = []
    for i, prompt in enumerate(args.prompt):
        wanted = len(pipeline.tokenizer.encode(prompt)) + args.max_new_tokens
        length = min(longest, -(-wanted // block) * block)
        sized = dataclasses.replace(pipeline, length=length)
        texts.append(sized(prompt, key=jax.random.fold_in(jax.random.key(args.seed), i)))
    return texts


def _images(pipeline, args) -> list[str]:
    """One PNG per label in ``--out`` (default ``RUN_DIR/samples``)."""
    import numpy as np

    try:
        from PIL import Image
    except ImportError:
        raise RecipeError(
            "--labels writes PNGs with pillow, which is not installed: pip install "
            "'dew-train[images]'; with uv: uv add 'dew-train[images]' in your project, or "
            "uv sync --all-packages --extra images in a Dew checkout"
        ) from None
    try:
        pixels = np.asarray(pipeline(args.labels, seed=args.seed))
    except ValueError as error:
        raise RecipeError(f"--labels: {error}") from None
    out = args.out or os.path.join(args.run_dir, "samples")
    os.makedirs(out, exist_ok=True)
    paths = []
    for i, (label, image) in enumerate(zip(args.labels, pixels, strict=True)):
        path = os.path.join(out, f"sample_{i:03d}_label_{label}.png")
        Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1 else image).save(path)
        paths.append(path)
    return paths
