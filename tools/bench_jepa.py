"""JEPA benchmarks, side by side: Dew's training step against a hand-written
jax/flax/optax loop, and Dew's feature extraction against transformers.

(a) training: ``Trainer.fit`` with ``JepaObjective`` against a hand-written
    loop on the same ``ViT`` encoder and ``ViTPredictor`` modules, the same
    multi-block masks (Dew's ``MaskLayout.sample``, drawn inside the step),
    the same loss (layer-normed target features, smooth L1, written out here),
    ``optax.adamw`` and an EMA target encoder updated by hand, in one
    ``jax.jit`` with donated state. Steady-state steps/s (the first step,
    which compiles, excluded), ratio Dew / hand-written.
(a') step (``--parts step``, not in the default): the two compiled steps alone,
    called back to back on batches already on the device (wall and CPU time),
    which separates the step's own extra work from the trainer's host loop.
(b) features: Dew's ``FeatureExtractor`` (one jitted ``ViT`` apply) against
    transformers' ``IJepaModel`` (eager torch, ``--torch-threads`` threads,
    ``torch.no_grad``) on the same weights: a random ``IJepaModel`` saved with
    ``save_pretrained`` and read by ``dew.sampling.Pretrained.load``. Both
    return ``last_hidden_state`` on the host; images/s, ratio Dew /
    transformers. Needs torch and transformers (``/tmp/parity/bin/python``);
    without them it is reported as not installed.

One process, one allocator setting (glibc ``mallopt``, PACKAGING.md); the
sides alternate, rates are the median of ``--repeats`` runs, and each ratio is
the median of the repeats' paired ratios (the two runs of a repeat are back
to back, so a change in the shared machine's load hits both).

    python tools/bench_jepa.py --parts train
    /tmp/parity/bin/python tools/bench_jepa.py                  # both parts
    /tmp/parity/bin/python tools/bench_jepa.py --train-sizes tiny --feature-sizes tiny \\
        --batches 8 64 --steps 30 --repeats 3
    python tools/bench_jepa.py --parts train --train-sizes tpu --steps 10 --repeats 1  # a chip
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import platform
import statistics
import sys
import tempfile
import time

# Both sides run under Dew's allocator setting (dew.nn.allocator; DEW_ALLOCATOR=system opts out),
# applied before anything allocates.
from dew.nn.allocator import configure_allocator  # noqa: E402

configure_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew.nn import ViT, ViTPredictor  # noqa: E402

# (a) encoder + predictor + batch; 4 target blocks (I-JEPA's masks)
TRAIN_SIZES = {
    "tiny": dict(
        image_size=32,
        patch_size=4,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        mlp_features=256,
        predictor_features=32,
        predictor_layers=1,
        batch=16,
    ),  # fmt: skip
    "small": dict(
        image_size=48,
        patch_size=4,
        emb_features=128,
        num_layers=4,
        num_heads=4,
        mlp_features=512,
        predictor_features=64,
        predictor_layers=2,
        batch=16,
    ),  # fmt: skip
    # a TPU chip's size: 256 patches of a 128x128 image, bfloat16 compute; about 1.9
    # TFLOP a step (the target encoder's forward, the context encoder's and the
    # predictor's forward and backward)
    "tpu": dict(
        image_size=128,
        patch_size=8,
        emb_features=768,
        num_layers=6,
        num_heads=12,
        mlp_features=3072,
        predictor_features=384,
        predictor_layers=3,
        predictor_heads=6,
        batch=32,
        dtype=jnp.bfloat16,
    ),  # fmt: skip
}
# (b) transformers IJepaConfig fields
FEATURE_SIZES = {
    "tiny": dict(
        image_size=32,
        patch_size=4,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
    ),  # fmt: skip
    "small": dict(
        image_size=64,
        patch_size=8,
        hidden_size=192,
        num_hidden_layers=6,
        num_attention_heads=3,
        intermediate_size=768,
    ),  # fmt: skip
}
LEARNING_RATE, WEIGHT_DECAY, MOMENTUM = 1e-3, 0.04, (0.996, 1.0)


# ------------------------------------------------------------------ training
def make_training(size: str, steps: int):
    cfg = TRAIN_SIZES[size]
    grid = dict(image_size=cfg["image_size"], patch_size=cfg["patch_size"], num_channels=3)
    dtype = cfg.get("dtype", jnp.float32)
    encoder = ViT(
        emb_features=cfg["emb_features"],
        num_layers=cfg["num_layers"],
        num_heads=cfg["num_heads"],
        mlp_features=cfg["mlp_features"],
        dtype=dtype,
        **grid,
    )
    predictor = ViTPredictor(
        encoder_features=cfg["emb_features"],
        emb_features=cfg["predictor_features"],
        num_layers=cfg["predictor_layers"],
        num_heads=cfg.get("predictor_heads", 2),
        mlp_features=4 * cfg["predictor_features"],
        dtype=dtype,
        **grid,
    )
    side = cfg["image_size"]
    images = np.random.default_rng(0).integers(0, 256, (4, cfg["batch"], side, side, 3))
    return encoder, predictor, images.astype(np.uint8)


def dew_training(size: str, steps: int):
    """The modules, images, dataset, objective and trainer of the Dew side."""
    from dew.data import Dataset
    from dew.objectives.jepa.jepa import JepaObjective
    from dew.train import Trainer

    encoder, predictor, images = make_training(size, steps)
    data = Dataset(
        train=lambda p: ({"image": x} for x in itertools.cycle(images)),
        val=None,
        records=0,
        batch=images.shape[1],
    )
    objective = JepaObjective(
        encoder=encoder, predictor=predictor, planned_updates=steps, momentum=MOMENTUM
    )
    trainer = Trainer(
        objective,
        optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY),
        key=jax.random.key(0),
        progress=False,
    )
    return encoder, predictor, images, data, objective, trainer


def run_dew_training(size: str, steps: int) -> tuple[float, float]:
    """(seconds to the first step, seconds per later step) of ``Trainer.fit``."""
    from _timing import fit_seconds  # tools/, this script's directory

    encoder, predictor, images, data, objective, trainer = dew_training(size, steps)
    return fit_seconds(trainer, data, steps)


def layer_norm(x, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def smooth_l1(d):
    a = jnp.abs(d)
    return jnp.where(a < 1.0, 0.5 * d * d, a - 0.5)


def build_hand_training(size: str, steps: int):
    """``(step, carry, images, root)``: the same step written as a plain jitted
    function with donated state, ``step(*carry, pixels, root) -> (*carry, loss)``."""
    from dew.objectives.jepa.masks import MultiBlock

    encoder, predictor, images = make_training(size, steps)
    grid = encoder.grid.shape
    layout = MultiBlock().layout(1, *grid)
    targets, target_keep = layout.spec.num_targets, layout.target_keep
    optimizer = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    @jax.jit
    def init(key):
        k_encoder, k_predictor = jax.random.split(key)
        pixels = jnp.zeros((1, *encoder.grid.pixel_shape(3)), jnp.float32)
        enc = encoder.init(k_encoder, pixels)["params"]
        features = encoder.emb_features
        pred = predictor.init(
            k_predictor,
            jnp.zeros((1, layout.context_keep, features)),
            jnp.zeros((1, layout.context_keep), jnp.int32),
            jnp.zeros((1, target_keep), jnp.int32),
        )["params"]
        params = jax.tree.map(
            lambda x: getattr(x, "value", x),
            {"encoder": enc, "predictor": pred},
            is_leaf=lambda x: hasattr(x, "value"),
        )
        return params, params["encoder"], optimizer.init(params)

    def loss_fn(params, target, pixels, key):
        x = pixels.astype(jnp.float32) / 127.5 - 1.0
        rows = x.shape[0]
        masks = layout.sample(key, rows)
        h = layer_norm(encoder.apply({"params": target}, x))  # [batch, patches, features]
        flat = masks.targets.reshape(rows, targets * target_keep)
        h = jnp.take_along_axis(h, flat[:, :, None], axis=1)
        context = encoder.apply({"params": params["encoder"]}, x, masks.context)
        z = predictor.apply(
            {"params": params["predictor"]},
            jnp.repeat(context, targets, axis=0),
            jnp.repeat(masks.context, targets, axis=0),
            masks.targets.reshape(rows * targets, target_keep),
        )  # [batch * blocks, patches, features]
        d = z.reshape(h.shape) - jax.lax.stop_gradient(h)
        return smooth_l1(d).mean()

    def step(params, target, opt_state, update, pixels, root):
        loss, grads = jax.value_and_grad(loss_fn)(
            params, target, pixels, jax.random.fold_in(root, update)
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        lo, hi = MOMENTUM
        m = lo + (hi - lo) * jnp.minimum(update.astype(jnp.float32) / steps, 1.0)
        target = jax.tree.map(lambda t, p: m * t + (1 - m) * p, target, params["encoder"])
        return params, target, opt_state, update + 1, loss

    step = jax.jit(step, donate_argnums=(0, 1, 2))
    params, target, opt_state = init(jax.random.key(0))
    return step, (params, target, opt_state, jnp.zeros((), jnp.int32)), images, jax.random.key(1)


def run_hand_training(size: str, steps: int) -> tuple[float, float]:
    """(seconds to the first step, seconds per later step) of the hand-written loop."""
    start = time.perf_counter()
    step, (params, target, opt_state, update), images, root = build_hand_training(size, steps)
    params, target, opt_state, update, loss = step(
        params, target, opt_state, update, jnp.asarray(images[0]), root
    )
    loss.block_until_ready()
    first = time.perf_counter() - start
    begin = time.perf_counter()
    for i in range(1, steps):
        params, target, opt_state, update, loss = step(
            params, target, opt_state, update, jnp.asarray(images[i % len(images)]), root
        )
    jax.block_until_ready((params, target, loss))
    return first, (time.perf_counter() - begin) / (steps - 1)


def bench_compiled_steps(sizes, steps, repeats) -> list[str]:
    """The two compiled steps alone, without Dew's host loop: Dew's step (taken
    from ``Trainer.fit``'s cache after a 2-step fit) called directly on batches
    already on the device, against the hand step; wall and process CPU time.
    What the end-to-end ratio loses beyond this ratio is the trainer's host loop.

    Dew's step gets the ``is_logged`` flag ``fit(steps=n, log_every=n)`` passes
    (True on a run's last step only); a third side, ``every``, passes True on
    every step: the work the step did before the flag (feature statistics, the
    SVD and the update norm each step), in the same alternation."""
    from dew.data import Partition
    from dew.train.placement import to_global
    from dew.train.step import logged_flag

    rows = []
    for size in sizes:
        encoder, predictor, images, data, objective, trainer = dew_training(size, steps)
        with contextlib.redirect_stdout(io.StringIO()):
            state = trainer.fit(data, steps=2, log_every=0)
        (dew_step,) = [c.program for c in trainer.programs.cache.update.values()]
        batches = [
            to_global({"image": x}, Partition(0, 1), len(x), trainer.device_mesh, trainer.rules)
            for x in images
        ]
        hand_step, carry, _, root = build_hand_training(size, steps)
        pixels = [jnp.asarray(x) for x in images]
        dew_box, hand_box = [state], [carry]
        flags = [logged_flag(trainer.device_mesh, f) for f in (False, True)]

        def dew_run(n, box=dew_box, step=dew_step, batches=batches, flags=flags, every=False):
            for i in range(n):
                logged = flags[every or i == n - 1]
                box[0], metrics = step(box[0], batches[i % len(batches)], logged)
            jax.block_until_ready((box[0], metrics))

        def every_run(n, run=dew_run):
            run(n, every=True)

        def hand_run(n, box=hand_box, step=hand_step, pixels=pixels, root=root):
            for i in range(n):
                *box[0], loss = step(*box[0], pixels[i % len(pixels)], root)
            jax.block_until_ready((box[0], loss))

        def timed(fn):
            wall, cpu = time.perf_counter(), time.process_time()
            fn(steps)
            return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps

        dew_run(2), every_run(2), hand_run(2)  # warm
        dew, hand, every = [], [], []
        for r in range(repeats):
            order = [(dew_run, dew), (hand_run, hand), (every_run, every)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(timed(fn))
        wall = statistics.median(h[0] / d[0] for d, h in zip(dew, hand, strict=True))
        cpu = statistics.median(h[1] / d[1] for d, h in zip(dew, hand, strict=True))
        e_wall = statistics.median(h[0] / d[0] for d, h in zip(every, hand, strict=True))
        e_cpu = statistics.median(h[1] / d[1] for d, h in zip(every, hand, strict=True))

        def ms(xs, i):
            return [round(x[i] * 1e3, 2) for x in xs]

        print(
            f"compiled step {size}: ms/step dew {ms(dew, 0)} hand {ms(hand, 0)} every "
            f"{ms(every, 0)}; CPU ms/step dew {ms(dew, 1)} hand {ms(hand, 1)} every "
            f"{ms(every, 1)}; median paired ratio hand/dew wall {wall:.3f} CPU {cpu:.3f}, "
            f"hand/every wall {e_wall:.3f} CPU {e_cpu:.3f}; load average "
            f"{open('/proc/loadavg').read().split()[:3]}",
            flush=True,
        )
        rows.append(
            f"| compiled step {size} (no host loop) | "
            f"{1 / statistics.median(x[0] for x in dew):.2f} steps/s | "
            f"{1 / statistics.median(x[0] for x in hand):.2f} steps/s | {wall:.3f} (CPU {cpu:.3f}) "
            f"| >= 0.97 | {'met' if wall >= 0.97 else 'not met'} |"
        )
    return rows


def bench_training(sizes, steps, repeats) -> list[str]:
    rows = []
    for size in sizes:
        dew, hand = [], []
        for r in range(repeats):
            order = [(run_dew_training, dew), (run_hand_training, hand)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(fn(size, steps))
        d_step = statistics.median(x[1] for x in dew)
        h_step = statistics.median(x[1] for x in hand)
        d_first = statistics.median(x[0] for x in dew)
        h_first = statistics.median(x[0] for x in hand)
        # the median of each repeat's paired ratio: the two sides of one repeat ran
        # back to back, so a load change on the shared machine hits both
        ratio = statistics.median(h[1] / d[1] for d, h in zip(dew, hand, strict=True))
        print(
            f"train {size}: steps/s dew {1 / d_step:.2f} hand {1 / h_step:.2f} "
            f"(per repeat: dew {[round(1 / x[1], 2) for x in dew]}, "
            f"hand {[round(1 / x[1], 2) for x in hand]}); first step dew {d_first:.2f} s "
            f"hand {h_first:.2f} s; median paired ratio {ratio:.3f}",
            flush=True,
        )
        rows.append(
            f"| train {size} | {1 / d_step:.2f} steps/s | {1 / h_step:.2f} steps/s "
            f"| {ratio:.3f} | >= 0.97 | {'met' if ratio >= 0.97 else 'not met'} |"
        )
    return rows


# ------------------------------------------------------------------ features
def not_installed(modules) -> str | None:
    """``'torch and transformers not installed (python)'``, or None when all import."""
    absent = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            absent.append(module)
    return f"{' and '.join(absent)} not installed ({sys.executable})" if absent else None


def bench_features(sizes, batches, calls, repeats, threads) -> list[str]:
    import torch
    import transformers

    from dew.sampling import FeatureExtractor, Pretrained

    torch.set_num_threads(threads)
    rows = []
    for size in sizes:
        cfg = FEATURE_SIZES[size]
        torch.manual_seed(0)
        hf = transformers.IJepaModel(
            transformers.IJepaConfig(**cfg, num_channels=3), add_pooling_layer=False
        ).eval()
        with tempfile.TemporaryDirectory() as directory:
            hf.save_pretrained(directory)
            pretrained = Pretrained.load(directory)
        side = cfg["image_size"]
        for batch in batches:
            extractor = FeatureExtractor(
                encoder=pretrained.model,
                params=pretrained.params,
                input_shape=(side, side, 3),
                pooling="none",
                batch_size=batch,
            )
            images = np.random.default_rng(0).uniform(-1, 1, (batch, side, side, 3))
            images = images.astype(np.float32)
            nchw = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))

            def torch_features(hf=hf, nchw=nchw):
                with torch.no_grad():
                    return hf(pixel_values=nchw).last_hidden_state.numpy()

            def dew_features(extractor=extractor, images=images):
                return extractor(images)

            np.testing.assert_allclose(dew_features(), torch_features(), rtol=1e-3, atol=1e-3)

            def seconds_per_call(fn):
                fn()  # warm (compiled on the Dew side)
                begin = time.perf_counter()
                for _ in range(calls):
                    fn()
                return (time.perf_counter() - begin) / calls

            dew, hf_times = [], []
            for r in range(repeats):
                order = [(dew_features, dew), (torch_features, hf_times)]
                for fn, out in order if r % 2 == 0 else order[::-1]:
                    out.append(seconds_per_call(fn))
            d, h = statistics.median(dew), statistics.median(hf_times)
            ratio = statistics.median(t / x for x, t in zip(dew, hf_times, strict=True))
            print(
                f"features {size} batch {batch}: images/s dew {batch / d:,.0f} transformers "
                f"{batch / h:,.0f} (per repeat: dew {[round(batch / x) for x in dew]}, "
                f"transformers {[round(batch / x) for x in hf_times]}); median paired "
                f"ratio {ratio:.2f}x",
                flush=True,
            )
            rows.append(
                f"| features {size} batch {batch} | {batch / d:,.0f} images/s | "
                f"{batch / h:,.0f} images/s | {ratio:.2f}x | >= 1.5x | "
                f"{'met' if ratio >= 1.5 else 'not met'} |"
            )
    return rows


# ---------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["train", "features"])
    parser.add_argument("--train-sizes", nargs="+", default=["tiny"])
    parser.add_argument("--feature-sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (>= 2)")
    parser.add_argument("--calls", type=int, default=10, help="extraction calls per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2)
    args = parser.parse_args()
    for flag, given, known in (
        ("--parts", args.parts, ("train", "step", "features")),
        ("--train-sizes", args.train_sizes, TRAIN_SIZES),
        ("--feature-sizes", args.feature_sizes, FEATURE_SIZES),
    ):
        unknown = [x for x in given if x not in known]
        if unknown:
            parser.error(f"unknown {flag} {unknown}; known: {', '.join(known)}")
    if args.steps < 2 or args.calls < 1 or args.repeats < 1 or min(args.batches) < 1:
        parser.error("--steps must be >= 2; --calls, --repeats and --batches >= 1")
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; median of "
        f"{args.repeats}, alternating",
        flush=True,
    )
    table = ["| benchmark | Dew | baseline | ratio Dew / baseline | goal | goal met |"]
    table.append("|---|---|---|---|---|---|")
    if "train" in args.parts:
        absent = not_installed(("dew.train", "dew.objectives", "dew.data"))
        if absent:
            print(f"train: skipped, {absent}; run with the workspace's .venv/bin/python")
            table.append(f"| train | - | {absent} | - | >= 0.97 | not measured |")
        else:
            table += bench_training(args.train_sizes, args.steps, args.repeats)
    if "step" in args.parts:
        absent = not_installed(("dew.train", "dew.objectives", "dew.data"))
        if absent:
            print(f"step: skipped, {absent}; run with the workspace's .venv/bin/python")
            table.append(f"| compiled step | - | {absent} | - | >= 0.97 | not measured |")
        else:
            table += bench_compiled_steps(args.train_sizes, args.steps, args.repeats)
    if "features" in args.parts:
        absent = not_installed(("torch", "transformers"))
        if absent:
            print(f"features: skipped, {absent}; run with /tmp/parity/bin/python")
            table.append(f"| features | - | {absent} | - | >= 1.5x | not measured |")
        else:
            import torch
            import transformers

            print(f"torch {torch.__version__}, transformers {transformers.__version__}")
            table += bench_features(
                args.feature_sizes, args.batches, args.calls, args.repeats, args.torch_threads
            )
    print("\n".join(table))


if __name__ == "__main__":
    main()
