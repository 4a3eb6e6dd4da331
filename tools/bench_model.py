"""Dew's CausalTransformer against a plain flax.linen GPT-2 of the same FLOPs.

One hand-written jitted training step (``value_and_grad`` + ``optax.adamw``,
params and optimizer state donated) for every network, so only the model
differs. The networks, all at the same width and depth:

- ``plain``: a GPT-2-style linen model written out here (fused-free q/k/v
  ``nn.Dense``, a constant causal mask, LayerNorm, GELU, learned positions);
- ``dew_gpt2``: ``CausalTransformer`` configured as the same network
  (``norm='layer'``, ``mlp_activation='gelu'``, ``position_embedding='learned'``,
  ``use_bias=True``), scanned layers (Dew's default ``use_scan``);
- ``dew_gpt2_unroll``: the same scanned parameters, the loop unrolled
  (``LayerStack.unroll = num_layers``);
- ``dew_gpt2_loop``: the same with ``use_scan=False``;
- ``dew_seed``: ``models.build("causal_transformer", ...)`` defaults (RMSNorm,
  RoPE, SwiGLU: 1.5x the MLP FLOPs), as a seed-style run builds it.

Every variant is compiled first; then the timed runs alternate over the
variants (the order rotates every repeat) and each variant's number is the
median of its repeats; ratios are plain step time / variant step time (above
1: the variant is faster), for wall time and for the process's CPU time per
step (steadier when other work shares the cores), each the median of the
per-repeat ratios. The allocator is tuned once for every side (glibc
``mallopt``, docs/performance.md; ``--allocator system`` leaves it).
``--profile`` prints, per variant, XLA's FLOPs of the compiled step and
counts of its HLO ops (dots, transposes, copies, gathers, scatters, dynamic
slices, while loops, XNNPACK/oneDNN calls). ``--xla-flags`` adds XLA flags to
``XLA_FLAGS`` before JAX creates its CPU backend (XLA reads them then, not at
``import jax``); ``--devices N`` splits the batch
over N emulated CPU devices (``--xla_force_host_platform_device_count``),
parameters replicated; ``--json`` prints one ``RESULT {json}`` line per variant
(tools/bench_xla_cpu.py reads it).

    python tools/bench_model.py                         # medium size, 20 steps x 5
    python tools/bench_model.py --size seed --profile
    python tools/bench_model.py --variants plain dew_gpt2_loop --repeats 7
    python tools/bench_model.py --variants plain --xla-flags=--xla_cpu_use_xnnpack=false
    python tools/bench_model.py --variants plain --devices 2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import statistics
import sys
import time


def tune_allocator() -> str:
    """The same allocator setting for every side: Dew's default (glibc ``mallopt``,
    dew.nn.allocator), or the C library's own with ``--allocator system``."""
    if "--allocator" in sys.argv:
        os.environ["DEW_ALLOCATOR"] = sys.argv[sys.argv.index("--allocator") + 1]
    from dew.nn.allocator import configure_allocator

    return configure_allocator()


ALLOCATOR = tune_allocator()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dew.nn import models  # noqa: E402

SIZES = {
    "seed": dict(emb=64, layers=2, heads=4, mlp=256, seq=64, batch=8),
    "medium": dict(emb=256, layers=4, heads=8, mlp=1024, seq=256, batch=16),
}
VOCAB = 264


class PlainBlock(nn.Module):
    emb: int
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x):
        b, t, e = x.shape
        d = e // self.heads
        h = nn.LayerNorm(epsilon=1e-6)(x)
        q = nn.Dense(e)(h).reshape(b, t, self.heads, d)
        k = nn.Dense(e)(h).reshape(b, t, self.heads, d)
        v = nn.Dense(e)(h).reshape(b, t, self.heads, d)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5
        causal = np.tril(np.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, e)
        x = x + nn.Dense(e)(out)
        h = nn.LayerNorm(epsilon=1e-6)(x)
        h = nn.Dense(e)(nn.gelu(nn.Dense(self.mlp)(h), approximate=True))
        return x + h


class PlainGPT(nn.Module):
    """GPT-2 (Radford et al., 2019) as a user would write it in linen."""

    emb: int
    layers: int
    heads: int
    mlp: int
    seq: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, self.emb)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.emb))
        x = x + pos[: tokens.shape[1]]
        for _ in range(self.layers):
            x = PlainBlock(self.emb, self.heads, self.mlp)(x)
        x = nn.LayerNorm(epsilon=1e-6)(x)
        return nn.Dense(VOCAB, use_bias=False)(x)


def network(variant: str, size: str) -> nn.Module:
    s = SIZES[size]
    if variant == "plain":
        return PlainGPT(s["emb"], s["layers"], s["heads"], s["mlp"], s["seq"])
    common = dict(
        vocab_size=VOCAB,
        emb_features=s["emb"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        mlp_features=s["mlp"],
        max_seq_len=s["seq"],
    )
    gpt2 = dict(norm="layer", mlp_activation="gelu", position_embedding="learned", use_bias=True)
    if variant == "dew_gpt2":
        return models.build("causal_transformer", **common, **gpt2)
    if variant == "dew_gpt2_unroll":
        return models.build("causal_transformer", **common, **gpt2, use_scan=True), s["layers"]
    if variant == "dew_gpt2_loop":
        return models.build("causal_transformer", **common, **gpt2, use_scan=False)
    if variant == "dew_seed":
        return models.build("causal_transformer", **common)
    raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


VARIANTS = ("plain", "dew_gpt2", "dew_gpt2_unroll", "dew_gpt2_loop", "dew_seed")


def build(variant: str, size: str, devices: int = 1):
    """``(step, params, opt_state, batches, compile seconds)`` with the step compiled;
    ``devices > 1``: the batch split over that many devices, parameters replicated."""
    model = network(variant, size)
    if isinstance(model, tuple):  # a scanned stack compiled with every layer unrolled
        model, unroll = model
        stack = type(model).layer_stack
        type(model).layer_stack = lambda self: dataclasses.replace(stack(self), unroll=unroll)
        try:
            return build_model(model, size, devices)
        finally:
            type(model).layer_stack = stack
    return build_model(model, size, devices)


def build_model(model, size: str, devices: int = 1):
    s = SIZES[size]
    optimizer = optax.adamw(3e-3)
    tokens0 = jnp.zeros((1, s["seq"]), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens0)["params"])
    opt_state = optimizer.init(params)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    params, opt_state = jax.device_put((params, opt_state), replicated)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(0)
    batches = [
        jax.device_put(rng.integers(0, 256, (s["batch"], s["seq"] + 1)).astype(np.int32), split)
        for _ in range(4)
    ]
    begin = time.perf_counter()
    jitted = jax.jit(
        step,
        in_shardings=(replicated, replicated, split),
        out_shardings=(replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )
    compiled = jitted.lower(params, opt_state, batches[0]).compile()
    seconds = time.perf_counter() - begin
    return compiled, params, opt_state, batches, seconds


OPS = ("dot", "transpose", "copy", "gather", "scatter", "dynamic-slice",
       "dynamic-update-slice", "while", "fusion", "reduce", "broadcast",
       "custom-call", "all-reduce")  # fmt: skip
# fusions XLA:CPU hands to a library: kind=__xnn_fusion (XNNPACK), __onednn_fusion
LIBRARY_FUSIONS = ("__xnn_fusion", "__onednn_fusion", "__ynn_fusion")


def profile(compiled) -> dict:
    """XLA's FLOPs and HLO op counts of a compiled step."""
    text = compiled.as_text()
    counts = collections.Counter()
    for line in text.splitlines():
        # the op is the first ``name(`` after ``=`` (a tuple type has no such word)
        m = re.search(r"= .*?\b([a-z][a-z\-]*)\(", line)
        if m and m.group(1) in OPS:
            counts[m.group(1)] += 1
    for kind in LIBRARY_FUSIONS:
        counts[kind] = text.count(f'"{kind}"')
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    kinds = (*OPS, *LIBRARY_FUSIONS)
    return {"flops": float(cost.get("flops", 0.0)), **{k: counts[k] for k in kinds}}


def timed(entry, steps: int) -> tuple[float, float]:
    """``(wall, cpu)`` seconds per step over ``steps`` steps (state carried, donated);
    cpu is this process's CPU time (every thread, user + system), the steadier
    figure on a machine shared with other work."""
    compiled, params, opt_state, batches, _ = entry
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(steps):
        params, opt_state, loss = compiled(params, opt_state, batches[i % len(batches)])
    jax.block_until_ready((params, loss))
    entry[1], entry[2] = params, opt_state
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--variants", nargs="+", default=["plain", "dew_gpt2", "dew_gpt2_loop",
                                                          "dew_seed"])  # fmt: skip
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--allocator", default="tuned", choices=["tuned", "system"])
    parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS (yours win)")
    parser.add_argument("--devices", type=int, default=1, help="split the batch over N")
    parser.add_argument("--json", action="store_true", help="one RESULT {json} line a variant")
    args = parser.parse_args(argv)
    add_xla_flags(args.xla_flags, args.devices)
    if args.size not in SIZES:
        sys.exit(f"unknown --size {args.size!r}; use one of {sorted(SIZES)}")
    for v in args.variants:
        if v not in VARIANTS:
            sys.exit(f"unknown variant {v!r}; use one of {list(VARIANTS)}")
    s = SIZES[args.size]
    print(
        f"{args.size} {s}; jax {jax.__version__}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s); {args.steps} steps, median of {args.repeats}; "
        f"allocator {ALLOCATOR}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    entries = {}
    for v in args.variants:
        entries[v] = list(build(v, args.size, args.devices))
        timed(entries[v], 2)  # warm
        if args.profile:
            p = profile(entries[v][0])
            ops = " ".join(f"{k} {p[k]}" for k in (*OPS, *LIBRARY_FUSIONS))
            print(f"  {v:14s} compile {entries[v][4]:.2f} s, {p['flops'] / 1e9:.3f} GFLOP; {ops}")
    times = {v: [] for v in args.variants}
    order = list(args.variants)
    for r in range(args.repeats):
        rot = order[r % len(order) :] + order[: r % len(order)]
        for v in rot:
            times[v].append(timed(entries[v], args.steps))
    tokens = s["batch"] * s["seq"]
    first = args.variants[0]
    for v in args.variants:
        wall = statistics.median(t[0] for t in times[v])
        cpu = statistics.median(t[1] for t in times[v])
        # paired per repeat: the variants of one repeat ran back to back
        wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(times[first], times[v]))
        cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(times[first], times[v]))
        print(
            f"  {v:16s} wall {wall * 1e3:8.1f} ms/step ({tokens / wall:8,.0f} tokens/s), "
            f"cpu {cpu * 1e3:8.1f} ms/step; {first}/this wall {wall_ratio:.3f} cpu "
            f"{cpu_ratio:.3f}; compile {entries[v][4]:.1f} s"
        )
        if args.json:
            record = dict(variant=v, wall_s=wall, cpu_s=cpu, tokens_per_s=tokens / wall,
                          walls=[t[0] for t in times[v]], cpus=[t[1] for t in times[v]],
                          compile_s=entries[v][4], xla_flags=os.environ.get("XLA_FLAGS", ""),
                          devices=jax.device_count())  # fmt: skip
            print("RESULT " + json.dumps(record), flush=True)


def add_xla_flags(flags: str, devices: int) -> None:
    """``--xla-flags`` and the device count of ``--devices`` added to ``XLA_FLAGS``
    after the user's own. Must run before the first ``jax.devices()``: XLA reads
    ``XLA_FLAGS`` when JAX creates its CPU backend, not at ``import jax``."""
    extra = flags.split()
    if devices > 1:
        extra.append(f"--xla_force_host_platform_device_count={devices}")
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()


if __name__ == "__main__":
    main()
