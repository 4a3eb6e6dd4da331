"""What makes JEPA learn or unlearn on small images: one setting varied at a time.

Trains Dew's ``JepaObjective`` under ``Trainer`` and the independent minimal
I-JEPA loop of ``tests/test_jepa_reference.py`` (its own masks, EMA and loss,
Dew's ViT modules as layers) with the same sizes, optimizer, data and budget,
and prints the probe accuracies of the random-initialised and the trained
context encoders (mean-pooled features): on scikit-learn's 8 x 8 digits the
standardised ridge probe and the cosine k-NN (k = 20) of
``examples/jepa_digits.py`` (1400 training digits, 397 test), on the toys the
ridge probe of the test.

    python tools/jepa_ablation.py digits [--variants base,reference,...] [--seeds 0]
    python tools/jepa_ablation.py waves|arrangements [--variants ...] [--seeds 0,1,2]

``--list`` names the variants. docs/jepa.md quotes the table it prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "jepa_reference", ROOT / "tests/test_jepa_reference.py"
)
ref = importlib.util.module_from_spec(_spec)
sys.modules["jepa_reference"] = ref
_spec.loader.exec_module(ref)


def digits_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 8.0 - 1.0).astype(np.float32)[..., None]  # [n, 8, 8, 1] in [-1, 1]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    train_rows, test_rows = order[:1400], order[1400:]

    def sample(rng, n):
        rows = rng.choice(train_rows, n, replace=False)
        return images[rows], labels[rows]

    split = (images[train_rows], labels[train_rows]), (images[test_rows], labels[test_rows])
    return sample, split


def digits_setup(**changes):
    """The digits settings docs/jepa.md's ablation table varies: examples/jepa_digits.py's
    until 2026-12-05 (predictor 64 x 2, lr 1e-3, momentum 0.99 -> 1); the example's
    now are the variant "predictor 128 x 4 + lr 1e-4 + momentum 0.996"."""
    from dew.nn import ViT, ViTPredictor

    grid = dict(image_size=8, patch_size=1, num_channels=1, position_embedding="learned")
    base = ref.Setup(
        encoder=ViT(emb_features=64, num_layers=2, num_heads=4, mlp_features=128, **grid),
        predictor=ViTPredictor(
            encoder_features=64,
            emb_features=64,
            num_layers=2,
            num_heads=2,
            mlp_features=128,
            **grid,
        ),
        steps=200,
        batch=64,
        learning_rate=1e-3,
        weight_decay=0.04,
        warmup=50,
        cosine=True,
        momentum=(0.99, 1.0),
        num_targets=3,
        context_keep=28,
        target_keep=8,
    )
    return vary(base, changes)


def toy_setup(toy, **changes):
    return vary(ref.toy_setup(toy), changes)


def vary(setup, changes):
    """``setup`` with ``changes``; ``predictor_<field>`` and ``encoder_<field>`` change
    a field of that module; ``position_embedding`` that of both."""
    modules = {"predictor": {}, "encoder": {}}
    rest = {}
    for name, value in changes.items():
        role, _, field = name.partition("_")
        if name == "position_embedding":
            modules["predictor"][name] = modules["encoder"][name] = value
        elif role in modules:
            modules[role][field] = value
        else:
            rest[name] = value
    return dataclasses.replace(
        setup,
        encoder=setup.encoder.clone(**modules["encoder"]),
        predictor=setup.predictor.clone(**modules["predictor"]),
        **rest,
    )


WIDE = {"predictor_emb_features": 128, "predictor_mlp_features": 256, "predictor_num_layers": 4}

# name: (side, setup changes, JepaObjective options)
VARIANTS = {
    "reference": ("reference", {}, {}),
    "base": ("dew", {}, {}),
    "momentum 0.996": ("dew", {"momentum": (0.996, 1.0)}, {}),
    "momentum 0.999": ("dew", {"momentum": (0.999, 1.0)}, {}),
    "reference momentum 0.996": ("reference", {"momentum": (0.996, 1.0)}, {}),
    "lr 3e-4": ("dew", {"learning_rate": 3e-4}, {}),
    "lr 3e-3": ("dew", {"learning_rate": 3e-3}, {}),
    "no warm-up": ("dew", {"warmup": 0}, {}),
    "weight decay 0": ("dew", {"weight_decay": 0.0}, {}),
    "weight decay 0.4": ("dew", {"weight_decay": 0.4}, {}),
    "predictor 32 wide": ("dew", {"predictor_emb_features": 32, "predictor_mlp_features": 64}, {}),
    "predictor 1 layer": ("dew", {"predictor_num_layers": 1}, {}),
    "predictor 4 layers": ("dew", {"predictor_num_layers": 4}, {}),
    "lr 1e-4": ("dew", {"learning_rate": 1e-4}, {}),
    "lr 3e-4 + predictor 4 layers": (
        "dew",
        {"learning_rate": 3e-4, "predictor_num_layers": 4},
        {},
    ),
    "sincos positions": ("dew", {"position_embedding": "sincos"}, {}),
    "sincos + lr 3e-4 + predictor 4 layers": (
        "dew",
        {"position_embedding": "sincos", "learning_rate": 3e-4, "predictor_num_layers": 4},
        {},
    ),
    "reference sincos positions": ("reference", {"position_embedding": "sincos"}, {}),
    "1000 steps": ("dew", {"steps": 1000}, {}),
    "predictor 128 x 4 + lr 3e-4": (
        "dew",
        {
            "predictor_emb_features": 128,
            "predictor_mlp_features": 256,
            "predictor_num_layers": 4,
            "learning_rate": 3e-4,
        },
        {},
    ),
    "patch 2": (  # a 4 x 4 grid of 2 x 2 pixels; Dew's default mask sizes there
        "dew",
        {
            "encoder_patch_size": 2,
            "predictor_patch_size": 2,
            "num_targets": 2,
            "context_keep": 8,
            "target_keep": 1,
        },
        {},
    ),
    "reference 1000 steps": ("reference", {"steps": 1000}, {}),
    "predictor 128 x 4 + lr 1e-4": ("dew", {**WIDE, "learning_rate": 1e-4}, {}),
    "predictor 128 x 4 + lr 1e-4 + momentum 0.996": (
        "dew",
        {**WIDE, "learning_rate": 1e-4, "momentum": (0.996, 1.0)},
        {},
    ),
    "lr 1e-4 + momentum 0.996": ("dew", {"learning_rate": 1e-4, "momentum": (0.996, 1.0)}, {}),
}
# the example's setting (wide predictor, lr 1e-4, momentum 0.996 -> 1) run longer, and at
# a lower momentum: runs where the target encoder keeps less of its initial weights
EXAMPLE = {**WIDE, "learning_rate": 1e-4, "momentum": (0.996, 1.0)}
VARIANTS |= {
    "example 700 steps": ("dew", {**EXAMPLE, "steps": 700}, {}),
    "example 1000 steps": ("dew", {**EXAMPLE, "steps": 1000}, {}),  # the example's default now
    "example 500 steps + momentum 0.99": (
        "dew",
        {**EXAMPLE, "steps": 500, "momentum": (0.99, 1.0)},
        {},
    ),
}


def run(side, setup, sample, seed, options):
    start = time.perf_counter()
    if side == "reference":  # the loop's target encoder is not probed
        initial, trained, _ = ref.train_reference(setup, sample, seed)
        target = None
    else:
        dew = ref.train_dew(setup, sample, seed, **options)
        initial, trained, target = dew.initial, dew.context, dew.target
    return initial, trained, time.perf_counter() - start, target


def features(encoder, params, x):
    import flax.linen as nn

    apply = jax.jit(lambda p, x: encoder.apply({"params": p}, x).mean(axis=1))
    return np.asarray(apply(nn.unbox(params), x), np.float64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=["digits", *ref.TOYS])
    parser.add_argument("--variants", default="reference,base")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    if args.list:
        print("\n".join(VARIANTS))
        return
    from dew.sampling.features import knn_accuracy, linear_probe_accuracy

    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"| {args.task} | seed | random init linear / k-NN | context linear / k-NN "
        "| target linear / k-NN | s |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.variants.split(","):
        side, changes, options = VARIANTS[name]
        rows = []
        for seed in seeds:
            if args.task == "digits":
                sample, ((xa, ya), (xb, yb)) = digits_data()
                setup = digits_setup(**changes)
                initial, trained, seconds, target = run(side, setup, sample, seed, options)
                scores = []
                for params in (initial, trained, target):
                    if params is None:
                        scores += [np.nan, np.nan]
                        continue
                    fa, fb = (
                        features(setup.encoder, params, xa),
                        features(setup.encoder, params, xb),
                    )
                    scores += [
                        linear_probe_accuracy(fa, ya, fb, yb),
                        knn_accuracy(fa, ya, fb, yb, k=20),
                    ]
            else:
                sample = ref.TOYS[args.task][0]
                setup = toy_setup(args.task, **changes)
                initial, trained, seconds, target = run(side, setup, sample, seed, options)
                scores = []
                for params in (initial, trained, target):
                    accuracy = (
                        np.nan
                        if params is None
                        else ref.probe_accuracy(setup.encoder, params, sample, seed)
                    )
                    scores += [accuracy, np.nan]
            rows.append([*scores, seconds])
            if len(seeds) > 1:
                print(f"| {name} | {seed} | " + _cells(rows[-1]), flush=True)
        print(f"| {name} | mean of {args.seeds} | " + _cells(np.mean(rows, axis=0)), flush=True)


def _cells(row) -> str:
    pairs = [f"{row[i]:.3f} / {row[i + 1]:.3f}" for i in (0, 2, 4)]
    return " | ".join(pairs) + f" | {row[6]:.0f} |"


if __name__ == "__main__":
    main()
