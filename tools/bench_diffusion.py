"""Diffusion benchmarks, side by side in one process (the two sides alternate; each
number is the median of ``--repeats`` runs; the same allocator setting for all):

1. **train**: a DiT training step, Dew's ``Trainer.fit`` with ``DiffusionObjective``
   (eps target, linear DDPM schedule, 10% label dropout, EMA 0.9999 with warm-up)
   against a hand-written jax + optax loop doing the same work on the same model.
   Ratio = hand step time / Dew step time (goal >= 0.97).
2. **sample**: DDIM, 50 steps, classifier-free guidance 4 (conditional and null rows
   in one batch), on the same tiny class-conditional DiT with learned sigma:
   Dew's ``ClassToImage`` pipeline (``Pretrained.load`` of the diffusers directory)
   against diffusers' ``DDIMScheduler`` loop as ``DiTPipeline`` runs it (without the
   VAE decode), torch on 2 threads. Ratio = diffusers time / Dew time (goal >= 2).
   Needs ``diffusers`` and ``torch``; skipped without them.
3. **loop**: Dew's sampler (``sample_diffusion`` + ``DDIM`` + ``model_denoiser``)
   against a hand-written ``lax.fori_loop`` DDIM sampler over the same network.
   Ratio = hand time / Dew time (goal >= 0.95).

    /tmp/torchenv/bin/python tools/bench_diffusion.py            # all three
    python tools/bench_diffusion.py --parts train loop --repeats 3
    python tools/bench_diffusion.py --size tpu --parts train --repeats 1 --steps 10  # a chip

``--size`` sets the training and loop parts' DiT: ``small`` (the default, below) or
``tpu``, a chip-sized one (32x32x4 latents in 2x2 patches, 256 tokens, width 768, 8
blocks, bfloat16 compute, batch 32: about 2.9 TFLOP a training step). The sample part
always runs its own small diffusers DiT.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import platform
import statistics
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
from _timing import fit_seconds, loop_seconds  # noqa: E402 (tools/, after the allocator)

from dew import Dataset, Trainer  # noqa: E402
from dew.nn import DiT  # noqa: E402
from dew.objectives.diffusion.images import DiffusionObjective, warmup_ema_decay  # noqa: E402
from dew.sampling import (  # noqa: E402
    DDIM,
    DDPMSchedule,
    Pretrained,
    model_denoiser,
    sample_diffusion,
)

# training: a small DiT on 16x16x4 latents (64 patches of 2x2)
TRAIN = dict(
    sample_size=16,
    patch_size=2,
    in_channels=4,
    emb_features=128,
    num_layers=4,
    num_heads=4,
    mlp_features=512,
    num_classes=10,
)
TRAIN_BATCH = 16
SIZES = {
    "small": dict(model=TRAIN, batch=TRAIN_BATCH),
    "tpu": dict(
        model=dict(
            sample_size=32,
            patch_size=2,
            in_channels=4,
            emb_features=768,
            num_layers=8,
            num_heads=12,
            mlp_features=3072,
            num_classes=10,
            dtype=jnp.bfloat16,
        ),
        batch=32,
    ),
}
# sampling: the same size with learned sigma, laid out as diffusers' DiT (4x MLP)
SAMPLE = dict(
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=4,
    out_channels=8,
    num_layers=4,
    sample_size=16,
    patch_size=2,
    num_embeds_ada_norm=10,
)
SAMPLE_BATCH, STEPS, GUIDANCE = 8, 50, 4.0
LABELS = list(range(SAMPLE_BATCH))


# ------------------------------------------------------------------ 1. training


def latent_shape(size):
    """``(height, width, channels)`` of one training latent of ``SIZES[size]``."""
    cfg = SIZES[size]["model"]
    return (cfg["sample_size"], cfg["sample_size"], cfg["in_channels"])


def train_rows(size):
    rng = np.random.default_rng(0)
    batch = SIZES[size]["batch"]
    return [
        {
            "latent": rng.normal(size=(batch, *latent_shape(size))).astype(np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int32),
        }
        for _ in range(4)
    ]


def ema():
    from dew.objectives.contract.objective import EMA

    return EMA(decay=functools.partial(warmup_ema_decay, max_decay=0.9999))


def run_dew_train(steps, size):
    rows, batch = train_rows(size), SIZES[size]["batch"]
    data = Dataset(train=lambda p: itertools.cycle(rows), val=None, records=4 * batch, batch=batch)
    objective = DiffusionObjective(
        model=DiT(**SIZES[size]["model"]), schedule=DDPMSchedule(), input_key="latent", ema=ema()
    )
    trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), progress=False)
    return fit_seconds(trainer, data, steps)


def run_hand_train(steps, size):
    """The same step by hand: t ~ U{0..999}, x_t = sqrt(abar) x0 + sqrt(1 - abar) eps,
    10% of labels replaced by the null class, MSE on eps, AdamW, EMA with warm-up."""
    rows = train_rows(size)
    model = DiT(**SIZES[size]["model"])
    optimizer = optax.adamw(1e-4)
    abar = jnp.asarray(DDPMSchedule().alphas_cumprod, jnp.float32)
    root = jax.random.key(0)
    start = time.perf_counter()

    @jax.jit
    def init(key):
        x, t = jnp.zeros((1, *latent_shape(size))), jnp.zeros((1,))
        params = model.init(key, x, t, label=jnp.zeros((1,), jnp.int32))["params"]
        params = jax.tree.map(
            lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value")
        )
        return params, optimizer.init(params), params

    def loss_fn(params, batch, key):
        k_time, k_noise, k_drop = jax.random.split(key, 3)
        x0 = batch["latent"]
        t = jax.random.randint(k_time, (x0.shape[0],), 0, 1000)
        noise = jax.random.normal(k_noise, x0.shape)
        a = abar[t][:, None, None, None]
        x_t = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
        drop = jax.random.bernoulli(k_drop, 0.1, (x0.shape[0],))
        label = jnp.where(drop, 10, batch["label"])
        eps = model.apply({"params": params}, x_t, t.astype(jnp.float32), label=label)
        return jnp.mean((eps - noise) ** 2)

    def step(params, opt_state, averaged, batch, index):
        key = jax.random.fold_in(root, index)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        decay = warmup_ema_decay(index, 0.9999)
        averaged = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, averaged, params)
        return params, opt_state, averaged, loss

    step = jax.jit(step, donate_argnums=(0, 1, 2))

    def advance(state, i):
        params, opt_state, averaged, _ = state
        batch = {k: jnp.asarray(v) for k, v in rows[i % len(rows)].items()}
        return step(params, opt_state, averaged, batch, i)

    return loop_seconds(start, advance, (*init(jax.random.key(0)), None), steps)


# ------------------------------------------------------------------ 2. and 3. sampling


def diffusers_checkpoint(directory):
    """A random diffusers DiT (its conditioning embedding copied into every block, as
    converted DiT checkpoints hold it) saved to ``directory``; returns the model."""
    import diffusers
    import torch

    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(**SAMPLE).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=generator))
        first = model.transformer_blocks[0].norm1.emb.state_dict()
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(first)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def run_diffusers(model, scheduler):
    """DiTPipeline.__call__'s loop (pipelines/dit/pipeline_dit.py) up to the latents."""
    import torch

    channels = SAMPLE["in_channels"]
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(0)
        latents = torch.randn((SAMPLE_BATCH, channels, 16, 16), generator=generator)
        x = torch.cat([latents] * 2)
        labels = torch.cat(
            [torch.tensor(LABELS), torch.full((SAMPLE_BATCH,), SAMPLE["num_embeds_ada_norm"])]
        )
        scheduler.set_timesteps(STEPS)
        for t in scheduler.timesteps:
            half = x[: len(x) // 2]
            x = scheduler.scale_model_input(torch.cat([half, half]), t)
            timesteps = t[None].expand(x.shape[0])
            out = model(x, timestep=timesteps, class_labels=labels).sample
            eps, rest = out[:, :channels], out[:, channels:]
            cond, uncond = torch.split(eps, len(eps) // 2)
            guided = uncond + GUIDANCE * (cond - uncond)
            out = torch.cat([torch.cat([guided, guided]), rest], dim=1)
            x = scheduler.step(out[:, :channels], t, x).prev_sample
        return x[:SAMPLE_BATCH].numpy()


def hand_sampler(model):
    """DDIM (eta 0) with guidance as one ``lax.fori_loop``, written out by hand."""
    abar = DDPMSchedule().alphas_cumprod
    ts = np.linspace(0, 999, STEPS).round().astype(np.int32)[::-1].copy()
    now = jnp.asarray(abar[ts], jnp.float32)
    prev = jnp.asarray(np.concatenate([abar[ts][1:], [1.0]]), jnp.float32)
    ts = jnp.asarray(ts)
    channels = model.in_channels

    @jax.jit
    def run(params, label, key):
        labels = jnp.concatenate([label, jnp.full_like(label, SAMPLE["num_embeds_ada_norm"])])

        def step(i, x):
            t = jnp.full((2 * x.shape[0],), ts[i], jnp.float32)
            out = model.apply({"params": params}, jnp.concatenate([x, x]), t, label=labels)
            cond, uncond = jnp.split(out[..., :channels], 2)
            eps = uncond + GUIDANCE * (cond - uncond)
            x0 = jnp.clip((x - jnp.sqrt(1 - now[i]) * eps) / jnp.sqrt(now[i]), -1, 1)
            eps = (x - jnp.sqrt(now[i]) * x0) / jnp.sqrt(1 - now[i])
            return jnp.sqrt(prev[i]) * x0 + jnp.sqrt(1 - prev[i]) * eps

        x = jax.random.normal(key, (label.shape[0], *model.sample_shape, channels), jnp.float32)
        return jax.lax.fori_loop(0, STEPS, step, x)

    return run


def dew_sampler(model):
    """Dew's sampler as the pipeline builds it: model_denoiser + DDIM + sample_diffusion."""
    schedule = DDPMSchedule()

    @jax.jit
    def run(params, label, key):
        denoise = model_denoiser(
            functools.partial(model.apply, {"params": params}),
            schedule=schedule,
            target="eps",
            learn_sigma=True,
            label=label,
            null_label=SAMPLE["num_embeds_ada_norm"],
            guidance=GUIDANCE,
            clip_denoised=1.0,
        )
        return sample_diffusion(
            denoise,
            schedule=schedule,
            sampler=DDIM(num_steps=STEPS),
            key=key,
            shape=(label.shape[0], *model.sample_shape, model.in_channels),
        )

    return run


def timed(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def alternate(sides, repeats):
    """``{name: median seconds}`` of ``sides = {name: thunk}``, run in alternating order."""
    times = {name: [] for name in sides}
    names = list(sides)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(timed(sides[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_sampling(parts, repeats, size):
    with tempfile.TemporaryDirectory() as directory:
        torch_model = None
        if "sample" in parts:
            try:
                import torch
                from diffusers import DDIMScheduler
            except ImportError:
                print("sample: skipped (needs diffusers and torch: run in the parity venv)")
                parts = [p for p in parts if p != "sample"]
        if "sample" in parts:
            torch.set_num_threads(2)
            torch_model = diffusers_checkpoint(directory)
            pretrained = Pretrained.load(directory)  # the same weights, in Dew's DiT
            model, params = pretrained.model, pretrained.params
        else:  # the training part's architecture, Dew's own random weights
            model = DiT(**SIZES[size]["model"], learn_sigma=True, mlp_norm_eps=1e-5)
            x = jnp.zeros((1, *latent_shape(size)))
            t, y = jnp.zeros((1,)), jnp.zeros((1,), jnp.int32)
            params = jax.jit(lambda k: model.init(k, x, t, label=y)["params"])(jax.random.key(0))
            params = jax.tree.map(
                lambda p: getattr(p, "value", p), params, is_leaf=lambda p: hasattr(p, "value")
            )
        label, key = jnp.asarray(LABELS, jnp.int32), jax.random.key(0)
        if "sample" in parts:
            pipe = pretrained.pipeline()  # ClassToImage: DDPM linear, eps, learned sigma
            scheduler = DDIMScheduler()  # DiT's training schedule: linear betas, 1000 steps
            start = time.perf_counter()
            pipe(LABELS, guidance=GUIDANCE, num_steps=STEPS, seed=0)
            dew_first = time.perf_counter() - start
            got = alternate(
                {
                    "dew": lambda: pipe(LABELS, guidance=GUIDANCE, num_steps=STEPS, seed=0),
                    "diffusers": lambda: run_diffusers(torch_model, scheduler),
                },
                repeats,
            )
            print(
                f"sample: DDIM {STEPS} steps, guidance {GUIDANCE}, {SAMPLE_BATCH} samples: dew "
                f"{got['dew']:.3f} s (first call {dew_first:.2f} s incl. compile), diffusers "
                f"{got['diffusers']:.3f} s; ratio {got['diffusers'] / got['dew']:.2f}x"
            )
        if "loop" in parts:
            dew_run, hand_run = dew_sampler(model), hand_sampler(model)
            for run in (dew_run, hand_run):  # compile both first
                jax.block_until_ready(run(params, label, key))
            sides = {
                "dew": lambda: dew_run(params, label, key),
                "hand": lambda: hand_run(params, label, key),
            }
            got = alternate(sides, repeats)
            print(
                f"loop: DDIM {STEPS} steps: dew sampler {got['dew']:.3f} s, hand-written "
                f"fori_loop {got['hand']:.3f} s; ratio {got['hand'] / got['dew']:.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ("train", "sample", "loop")
    parser.add_argument("--parts", nargs="+", default=list(parts), choices=parts)
    parser.add_argument("--size", default="small", choices=list(SIZES), help="the DiT trained")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; median of "
        f"{args.repeats}"
    )
    if "train" in args.parts:
        dew, hand = [], []
        for r in range(args.repeats):
            order = [(run_dew_train, dew), (run_hand_train, hand)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(fn(args.steps, args.size))
        d_step = statistics.median(x[1] for x in dew)
        h_step = statistics.median(x[1] for x in hand)
        d_first = statistics.median(x[0] for x in dew)
        h_first = statistics.median(x[0] for x in hand)
        side, _, channels = latent_shape(args.size)
        print(
            f"train: DiT step ({SIZES[args.size]['batch']} x {side}x{side}x{channels} latents, "
            f"{args.steps} steps) dew "
            f"{1000 * d_step:.1f} ms, hand {1000 * h_step:.1f} ms; ratio {h_step / d_step:.3f}; "
            f"first step dew {d_first:.2f} s, hand {h_first:.2f} s"
        )
    bench_sampling([p for p in args.parts if p != "train"], args.repeats, args.size)


if __name__ == "__main__":
    main()
