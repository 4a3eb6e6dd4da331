"""Flow-GRPO's rollout and update against hand-written jax/flax/optax code.

Two speed ratios, hand-written time / Dew time (1.0 = as fast, above 1 = Dew faster):

- rollout: ``FlowGRPOObjective.prepare`` compiled (the SDE sampler with per-step
  log-probs of ``dew.sampling.flow_sde``, per-row draws, the window's states, the
  compiled reward) against a hand-written ``lax.fori_loop`` Euler-Maruyama sampler on
  the same DiT with the same guidance, writing the states and log-probs into buffers,
  and the same reward, in one ``jax.jit``;
- update: one Adam update of the Flow-GRPO loss over the rollout (``jax.grad`` of
  ``FlowGRPOObjective.loss`` + optax) against a hand-written loss (the step's mean, the
  Gaussian log-prob, the clipped ratio, the KL to the reference) + optax.

The two sides alternate (``--repeats`` rounds, median of each); ``--parts`` measures
the rollout or the update alone (the update still runs Dew's rollout once for its
batch), each part's line printed as soon as it is measured. A last line runs
``Trainer.fit`` for ``--fit-steps`` iterations (0: not run) and prints its rollout
images per second (rollout samples / prepare seconds, from the log).

``--size small`` (the default) is a DiT on 8x8x1 images that a CPU runs in
milliseconds; ``--size tpu`` a chip-sized one (32x32x4 latents in 2x2 patches, 256
tokens, width 768, 6 blocks, bfloat16 compute) with its own rollout defaults (2 x 4
rows, 4 SDE steps: about 1.4 TFLOP a rollout and 5.6 an update).

    python tools/bench_flow_grpo.py [--repeats 7] [--groups 8] [--group-size 8]
    python tools/bench_flow_grpo.py --size tpu --repeats 2 --fit-steps 0
    python tools/bench_flow_grpo.py --size tpu --repeats 5 --fit-steps 0 --parts update
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset
from dew.nn.backbones import DiT
from dew.objectives import Step
from dew.objectives.rl.flow_grpo import FlowGRPOObjective, ImageReward
from dew.sampling import FlowSDE
from dew.train import MeshSpec, Trainer

SIZES = {
    "small": dict(
        model=dict(sample_size=8, patch_size=2, in_channels=1, emb_features=64, num_layers=2,
                   num_heads=4, mlp_features=128),
        groups=8, group_size=8, steps=10,
    ),
    "tpu": dict(
        model=dict(sample_size=32, patch_size=2, in_channels=4, emb_features=768, num_layers=6,
                   num_heads=12, mlp_features=3072, dtype=jnp.bfloat16),
        groups=2, group_size=4, steps=4,
    ),
}  # fmt: skip
parser = argparse.ArgumentParser()
parser.add_argument("--size", default="small", choices=list(SIZES))
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--groups", type=int, help="prompts (labels) a rollout; default: the size's")
parser.add_argument("--group-size", type=int, help="samples a label; default: the size's")
parser.add_argument("--steps", type=int, help="SDE steps of a rollout; default: the size's")
parser.add_argument("--fit-steps", type=int, default=6, help="Trainer.fit iterations; 0 = none")
parser.add_argument("--parts", nargs="+", choices=["rollout", "update"],
                    default=["rollout", "update"], help="the ratios to measure")  # fmt: skip
args = parser.parse_args()
size = SIZES[args.size]
for name in ("groups", "group_size", "steps"):
    if getattr(args, name) is None:
        setattr(args, name, size[name])

GUIDANCE = 2.0
model = DiT(**size["model"], num_classes=10)
SHAPE = (*model.sample_shape, model.in_channels)


def brightness(pixels, batch):
    return jnp.mean(pixels.astype(jnp.float32), axis=(1, 2, 3)) / 255.0


sampler = FlowSDE(num_steps=args.steps)
objective = FlowGRPOObjective(
    model=model,
    rewards=[ImageReward(fn=brightness)],
    group_size=args.group_size,
    sampler=sampler,
    guidance=GUIDANCE,
    timestep_fraction=1.0,
    epsilon=0.2,
)
variables = nn.unbox(objective.init(jax.random.key(0)))
labels = np.arange(args.groups, dtype=np.int32) % 10
batch = {"label": labels}
rows = args.groups * args.group_size
step = Step(index=jnp.int32(0), key=jax.random.key(1))

# ------------------------------------------------------------------ rollout
dew_rollout = jax.jit(objective.prepare)
table = {k: jnp.asarray(v, jnp.float32) for k, v in sampler.table().items()}


def guided_velocity(params, x, t, label):
    both = jnp.concatenate([label, jnp.full_like(label, 10)])
    out = model.apply(
        {"params": params["policy"]},
        jnp.concatenate([x, x]),
        jnp.full((2 * x.shape[0],), 1000.0 * t),
        label=both,
    )
    cond, uncond = jnp.split(out.astype(jnp.float32), 2)
    return uncond + GUIDANCE * (cond - uncond)


@jax.jit
def hand_rollout(params, label, key):
    label = jnp.repeat(label, args.group_size)
    k0, k1 = jax.random.split(key)
    x = jax.random.normal(k0, (rows, *SHAPE))
    states = jnp.zeros((args.steps + 1, rows, *SHAPE)).at[0].set(x)
    logps = jnp.zeros((args.steps, rows))

    def body(i, carry):
        x, states, logps = carry
        v = guided_velocity(params, x, table["t"][i], label)
        mean = table["c_x"][i] * x + table["c_v"][i] * v
        std = table["std"][i]
        x = mean + std * jax.random.normal(jax.random.fold_in(k1, i), x.shape)
        lp = -((x - mean) ** 2) / (2 * std**2) - jnp.log(std) - 0.5 * math.log(2 * math.pi)
        return x, states.at[i + 1].set(x), logps.at[i].set(jnp.mean(lp, axis=(1, 2, 3)))

    x, states, logps = jax.lax.fori_loop(0, args.steps, body, (x, states, logps))
    pixels = jnp.clip(jnp.round((x + 1) * 127.5), 0, 255).astype(jnp.uint8)
    return states, logps, brightness(pixels, None)


# ------------------------------------------------------------------- update
rollout = dew_rollout(variables, batch, step)
host = objective.prepare_host(jax.device_get(rollout))
train_batch = jax.jit(objective.prepare_finish)(variables, {**rollout, **host}, step)
optimizer = optax.adam(1e-4)
params = variables["params"]  # keyed by role: the DiT's own tree under "policy"
opt_state = optimizer.init(params)


@jax.jit
def dew_update(params, opt_state, train_batch):
    def loss_of(p):
        return objective.loss({**variables, "params": p}, train_batch, step)[0].value

    grads = jax.grad(loss_of)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@jax.jit
def hand_update(params, opt_state, lat, old, adv, label):
    n = args.steps
    x = lat[:, :-1].reshape(rows * n, *SHAPE)
    x_next = lat[:, 1:].reshape(rows * n, *SHAPE)
    lbl = jnp.repeat(label, n)
    t = jnp.tile(table["t"], rows)
    c_x, c_v = (jnp.tile(table[k], rows)[:, None, None, None] for k in ("c_x", "c_v"))
    std = jnp.tile(table["std"], rows)[:, None, None, None]
    sigma = jnp.tile(table["sigma"], rows)[:, None, None, None]
    adv = jnp.clip(jnp.repeat(adv, n), -5, 5)

    def velocity(p):
        both = jnp.concatenate([lbl, jnp.full_like(lbl, 10)])
        out = model.apply({"params": p}, jnp.concatenate([x, x]),
                          jnp.concatenate([1000.0 * t, 1000.0 * t]), label=both)  # fmt: skip
        cond, uncond = jnp.split(out.astype(jnp.float32), 2)
        return uncond + GUIDANCE * (cond - uncond)

    ref_mean = jax.lax.stop_gradient(c_x * x + c_v * velocity(variables["reference"]["params"]))

    def loss_of(p):
        mean = c_x * x + c_v * velocity(p["policy"])
        lp = -((x_next - mean) ** 2) / (2 * std**2) - jnp.log(std) - 0.5 * math.log(2 * math.pi)
        ratio = jnp.exp(jnp.mean(lp, axis=(1, 2, 3)) - old.reshape(-1))
        pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 0.8, 1.2))
        kl = jnp.mean((mean - ref_mean) ** 2 / (2 * sigma**2), axis=(1, 2, 3))
        return jnp.mean(pg + objective.beta * kl)

    grads = jax.grad(loss_of)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def timed(fn, *a):
    start = time.perf_counter()
    jax.block_until_ready(fn(*a))
    return time.perf_counter() - start


hand_args = (
    train_batch["latents"],
    train_batch["old_logps"],
    train_batch["advantages"],
    train_batch["label"],
)
programs = {
    "dew rollout": lambda: dew_rollout(variables, batch, step),
    "hand rollout": lambda: hand_rollout(params, labels, jax.random.key(1)),
    "dew update": lambda: dew_update(params, opt_state, train_batch),
    "hand update": lambda: hand_update(params, opt_state, *hand_args),
}
programs = {name: fn for name, fn in programs.items() if name.split()[1] in args.parts}
result = {"rows": rows, "steps": args.steps}
for part in args.parts:  # each part printed when measured (a chip's call may end first)
    pair = {name: fn for name, fn in programs.items() if name.endswith(part)}
    for fn in pair.values():  # compile
        jax.block_until_ready(fn())
    times = {name: [] for name in pair}
    for _ in range(args.repeats):
        for name, fn in pair.items():
            times[name].append(timed(fn))
    median = {name: statistics.median(t) for name, t in times.items()}
    result.update({f"{k} ms": round(1e3 * v, 2) for k, v in median.items()})
    result[f"{part} ratio (hand / dew)"] = round(median[f"hand {part}"] / median[f"dew {part}"], 3)
    if part == "rollout":
        result["dew rollout images/s"] = round(rows / median["dew rollout"], 1)
    print(json.dumps({k: v for k, v in result.items() if part in k}), flush=True)

# ---------------------------------------------------- through Trainer.fit
if args.fit_steps:
    with tempfile.TemporaryDirectory() as run_dir:
        stream = lambda partition: iter(lambda: batch, None)  # noqa: E731
        data = Dataset(train=stream, val=None, records=0, batch=args.groups)
        mesh = MeshSpec(data=1, devices=jax.devices()[:1])
        trainer = Trainer(objective, optimizer, key=jax.random.key(0), run_dir=run_dir,
                          mesh=mesh, progress=False)  # fmt: skip
        trainer.fit(data, steps=args.fit_steps, log_every=2)
        logs = [json.loads(x) for x in open(f"{run_dir}/metrics.jsonl")]
        train = [r for r in logs if r.get("kind") == "train"][1:]  # after the compiling interval
        rates = [
            r["rollout_samples"] / r["prepare_seconds"] for r in train if r.get("prepare_seconds")
        ]
        result["fit rollout images/s"] = round(statistics.median(rates), 1) if rates else None
print(json.dumps(result, indent=1))
