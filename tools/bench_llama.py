"""Dew's Llama-style CausalTransformer against Tunix's Llama3, in one hand-written loop.

One jitted training step (``value_and_grad`` + ``optax.adamw(3e-3)``, params and
optimizer state donated) for each network, in one process on one jax, so only
the model (and its loss, where the variant says so) differs:

- ``dew``: ``models.build("causal_transformer", ...)`` defaults (RMSNorm, RoPE,
  SwiGLU, no biases; the peer suite's ``dew_llama``), loss
  ``optax.softmax_cross_entropy_with_integer_labels`` over ``seq`` targets;
- ``tunix``: ``tunix.models.llama3.Llama3`` (flax nnx, split into a graph and a
  parameter tree) under Tunix's own ``PeftTrainer`` loss and inputs, as
  tools/bench_peers/tunix_side.py trains it: rows of ``seq + 1`` tokens through
  the model, positions and a ``[batch, length, length]`` causal mask built from
  the all-True input mask inside the step (``tunix.sft.utils``), the one-hot
  log-softmax loss of ``peft_trainer._default_loss_fn``;
- ``tunix_seq``: the same Llama3 under ``dew``'s loss and inputs (``seq``
  tokens, constant positions and causal mask): only the model differs.

Runs under a Python that has Tunix (``/work/peers/tunix/bin/python``,
tools/bench_peers/tunix_side.py says how to install it); Dew's packages are
imported from this checkout when that Python lacks them. Without Tunix only
``dew`` runs. Timing as tools/bench_model.py: every variant compiled and
warmed, then the timed runs alternate over the variants (the order rotating)
and each ratio is the median of the per-repeat ratios, on the process's CPU
time and on wall time. ``--profile`` prints XLA's FLOPs and HLO op counts of
each compiled step (tools/bench_model.py ``profile``).

    /work/peers/tunix/bin/python tools/bench_llama.py --size medium --profile
    /work/peers/tunix/bin/python tools/bench_llama.py --size seed --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
try:
    import dew.nn  # noqa: F401
except ImportError:  # a peer's venv: Dew's model packages from this checkout
    sys.path.insert(0, str(ROOT / "packages/dew-nn/src"))
sys.path.insert(0, str(ROOT / "tools"))

import bench_model  # noqa: E402  (applies Dew's allocator setting first)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

VARIANTS = ("dew", "tunix", "tunix_seq")


def dew_step(size: str):
    """``(loss_fn, params)`` of Dew's Llama-style model on ``[batch, seq + 1]`` rows."""
    model = bench_model.network("dew_seed", size)
    seq = bench_model.SIZES[size]["seq"]
    import flax.linen as nn

    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"])

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])  # [batch, seq, vocab]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn, params


def tunix_step(size: str, *, own_loss: bool):
    """``(loss_fn, params)`` of Tunix's Llama3 at the suite's size; ``own_loss``:
    Tunix's PeftTrainer loss and inputs (``seq + 1`` tokens through the model)."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.sft import peft_trainer, utils

    s = bench_model.SIZES[size]
    config = llama3.ModelConfig(
        num_layers=s["layers"], vocab_size=bench_model.VOCAB, embed_dim=s["emb"],
        hidden_dim=s["mlp"], num_heads=s["heads"], head_dim=s["emb"] // s["heads"],
        num_kv_heads=s["heads"], rope_theta=10_000, norm_eps=1e-6,
    )  # fmt: skip
    graph, params = nnx.split(llama3.Llama3(config, rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.tree.map(lambda p: p, params)  # plain arrays in an nnx.State

    def model(params):
        return nnx.merge(graph, params)

    if own_loss:

        def loss_fn(params, tokens):
            mask = jnp.ones(tokens.shape, jnp.bool_)
            return peft_trainer._default_loss_fn(
                model(params), tokens, mask, utils.build_positions_from_mask(mask),
                utils.make_causal_attn_mask(mask),
            )  # fmt: skip

        return loss_fn, params

    seq = s["seq"]
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (1, seq))
    causal = np.tril(np.ones((1, seq, seq), bool))

    def loss_fn(params, tokens):
        logits, _ = model(params)(tokens[:, :-1], positions, None, causal)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss_fn, params


def build(variant: str, size: str):
    """``[compiled step, params, opt_state, batches, compile seconds]``, as
    tools/bench_model.py's ``build`` (so its ``timed`` and ``profile`` apply)."""
    import time

    if variant == "dew":
        loss_fn, params = dew_step(size)
    else:
        loss_fn, params = tunix_step(size, own_loss=variant == "tunix")
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(params)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    s = bench_model.SIZES[size]
    rng = np.random.default_rng(0)
    batches = [
        jnp.asarray(rng.integers(0, 256, (s["batch"], s["seq"] + 1)).astype(np.int32))
        for _ in range(4)
    ]
    begin = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batches[0]).compile()
    return [compiled, params, opt_state, batches, time.perf_counter() - begin]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=sorted(bench_model.SIZES))
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    try:
        import tunix  # noqa: F401

        has_tunix = True
    except ImportError:
        has_tunix = False
    variants = args.variants or (["dew", "tunix", "tunix_seq"] if has_tunix else ["dew"])
    if not has_tunix and set(variants) - {"dew"}:
        sys.exit(
            f"{sys.executable} has no tunix; use /work/peers/tunix/bin/python (or --variants dew)"
        )
    s = bench_model.SIZES[args.size]
    print(
        f"{args.size} {s}; python {sys.version.split()[0]}, jax {jax.__version__}; "
        f"{args.steps} steps x {args.repeats} repeats; allocator {bench_model.ALLOCATOR}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; load {os.getloadavg()}",
        flush=True,
    )
    entries = {}
    for v in variants:
        entries[v] = build(v, args.size)
        bench_model.timed(entries[v], 2)  # warm
        if args.profile:
            p = bench_model.profile(entries[v][0])
            ops = " ".join(f"{k} {p[k]}" for k in bench_model.OPS if p[k])
            print(f"  {v:10s} compile {entries[v][4]:.1f} s, {p['flops'] / 1e9:.3f} GFLOP; {ops}")
    times = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            times[v].append(bench_model.timed(entries[v], args.steps))
    tokens = s["batch"] * s["seq"]
    first = variants[0]
    for v in variants:
        wall = statistics.median(t[0] for t in times[v])
        cpu = statistics.median(t[1] for t in times[v])
        # this / first: above 1 means the first variant (dew) is faster
        wall_ratio = statistics.median(b[0] / a[0] for a, b in zip(times[first], times[v]))
        cpu_ratio = statistics.median(b[1] / a[1] for a, b in zip(times[first], times[v]))
        print(
            f"  {v:10s} wall {wall * 1e3:7.1f} ms/step ({tokens / wall:7,.0f} tokens/s), "
            f"cpu {cpu * 1e3:7.1f} ms/step; this/{first}: cpu {cpu_ratio:.3f} wall "
            f"{wall_ratio:.3f}"
        )
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
