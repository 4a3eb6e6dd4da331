"""Mixture-of-experts training steps under each dispatch of :class:`dew.nn.MoE`,
side by side in one process, against a dense model of the same active
parameters (a SwiGLU MLP of width ``k * features``) as the bar:

- ``dense``: every expert on every token (the reference);
- ``capacity`` dropless (``[expert, tokens, embed]`` buckets: as dense) and with
  ``--capacity-factor`` (the fast CPU path; it drops what overflows);
- ``blocked``: dropless, sorted by expert and padded to blocks, one batched matmul;
- ``ragged``: ``jax.lax.ragged_dot`` (XLA:CPU lowers it to a dense masked product).

``--mode layer`` (the default) times one MoE layer's jitted step (forward and
backward to its weights and its input, as inside a network) on one row of
``--tokens`` tokens; ``--mode lm`` the whole training
step (loss, gradients) of the medium LM (emb 256, 4 layers, 8 heads, seq 256,
batch 16) with an MoE in every layer, against the same LM with a dense MLP of
width ``k * features``. The runs are interleaved (one step group of each, then
the next round), and each figure is the median over ``--repeats`` rounds of
groups of 3 steps, in wall and in this process's CPU time (every thread), with
each program's matrix-product FLOPs and XLA's bytes accessed; the load average
is printed before and after. ``--phases`` (layer mode) times the parts of the
routed capacity layer on their own, forward and forward + backward: the
router (logits, top-k, balance loss), the layout (one sort of the assignments
and the index maps), the dispatch gather, the experts' batched matmuls and the
combine.

``--against REV`` (layer mode) adds the same MoE runs with ``dew.nn.moe`` and
its dispatch module as they were at git revision ``REV``, interleaved with
today's: a before/after in one process.

    python tools/bench_moe.py
    python tools/bench_moe.py --experts 32 --features 128 --phases
    python tools/bench_moe.py --experts 32 --features 128 --runs capacity blocked --against b117c06
    python tools/bench_moe.py --mode lm --experts 32 --features 512 --runs capacity
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time
import types

RUNS = ("dense", "capacity_dropless", "capacity", "blocked", "ragged")
LM = dict(emb_features=256, num_layers=4, num_heads=8, max_seq_len=256)  # the medium LM
LM_BATCH, LM_VOCAB = 16, 264


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("layer", "lm"), default="layer")
    parser.add_argument("--tokens", type=int, default=2048, help="layer mode: tokens in the row")
    parser.add_argument("--embed", type=int, default=256, help="layer mode: the model width")
    parser.add_argument("--features", type=int, default=512, help="each expert's width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--runs", nargs="+", choices=RUNS, default=list(RUNS), help="the MoE runs (with the bar)"
    )
    parser.add_argument("--phases", action="store_true", help="layer mode: time the parts too")
    parser.add_argument("--against", help="layer mode: also the MoE of this git revision")
    args = parser.parse_args(argv)
    if min(args.tokens, args.embed, args.features, args.experts, args.k, args.repeats) < 1:
        parser.error("--tokens, --embed, --features, --experts, --k and --repeats must be >= 1")
    if args.k > args.experts or args.capacity_factor <= 0:
        parser.error(f"need 1 <= --k ({args.k}) <= --experts ({args.experts}) and a factor > 0")
    if (args.phases or args.against) and args.mode != "layer":
        parser.error("--phases and --against are for --mode layer")
    return args


def cost(fn, arguments) -> tuple[float, float]:
    """``(matmul FLOPs, bytes accessed)`` of a program: the FLOPs counted on its
    jaxpr (:func:`dew.train.throughput.program_flops`: XLA:CPU's cost analysis
    leaves out some of the dots it hands to YNNPACK), the bytes by XLA."""
    import jax

    from dew.train.throughput import program_flops

    analysis = fn.lower(*arguments).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    flops = program_flops(jax.make_jaxpr(fn)(*arguments))
    return flops, float(analysis.get("bytes accessed", 0.0))


def moe_at(revision: str):
    """The ``MoE`` class of ``dew.nn.moe`` at git ``revision``, with that revision's
    dispatch module (``dew.nn._moe_dispatch``) beside it; the rest is today's."""
    root = pathlib.Path(__file__).resolve().parent.parent
    src = "packages/dew-nn/src/dew/nn"

    def source(name):
        return subprocess.check_output(["git", "show", f"{revision}:{src}/{name}"], cwd=root)

    dispatch = types.ModuleType(f"moe_dispatch_{revision}")
    exec(compile(source("_moe_dispatch.py"), f"{revision}:_moe_dispatch.py", "exec"),
         dispatch.__dict__)  # fmt: skip
    text = source("moe.py").decode().replace("from dew.nn import _moe_dispatch as dispatches\n", "")
    moe = types.ModuleType(f"moe_{revision}")
    moe.__dict__["dispatches"] = dispatch
    sys.modules[moe.__name__] = moe
    exec(compile(text, f"{revision}:moe.py", "exec"), moe.__dict__)
    return moe.MoE


def programs(args):
    """``{name: (jitted, arguments)}``: the bar first, then each MoE run."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from dew.nn import MLP, CausalTransformer, MoE

    moe = dict(num_experts=args.experts, experts_per_token=args.k)
    kinds = {
        "dense": dict(dispatch="dense"),
        "capacity_dropless": dict(dispatch="capacity"),
        "capacity": dict(dispatch="capacity", capacity_factor=args.capacity_factor),
        "blocked": dict(dispatch="blocked"),
        "ragged": dict(dispatch="ragged"),
    }
    labels = {
        "dense": "MoE dense dispatch",
        "capacity_dropless": "MoE capacity, dropless",
        "capacity": f"MoE capacity, factor {args.capacity_factor:g}",
        "blocked": "MoE blocked, dropless",
        "ragged": "MoE ragged_dot, dropless",
    }
    if args.mode == "layer":
        x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.embed))  # one row
        modules = {"dense MLP, same active params": MLP(features=args.k * args.features)}
        for run in args.runs:
            modules[labels[run]] = MoE(features=args.features, **moe, **kinds[run])
            if args.against:
                before = moe_at(args.against)
                modules[f"{labels[run]} @{args.against}"] = before(
                    features=args.features, **moe, **kinds[run]
                )
    else:
        x = jax.random.randint(jax.random.key(0), (LM_BATCH, LM["max_seq_len"]), 0, LM_VOCAB)
        base = dict(vocab_size=LM_VOCAB, **LM)
        modules = {
            "dense LM, same active params": CausalTransformer(
                mlp_features=args.k * args.features, **base
            )
        }
        for run in args.runs:
            options = {f"moe_{k}": v for k, v in kinds[run].items()}
            modules[f"{labels[run]} LM"] = CausalTransformer(
                mlp_features=args.features, **moe, **options, **base
            )
    out = {}
    for name, module in modules.items():
        params = nn.unbox(module.init(jax.random.key(1), x)["params"])

        def loss(p, x, module=module):
            y, sown = module.apply({"params": p}, x, mutable=["intermediates"])
            if args.mode == "lm":  # next-token cross-entropy
                logp = jax.nn.log_softmax(y[:, :-1])
                y = jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)
            return jnp.mean(y**2), sown

        # the layer's input gradient too, as inside a network (not of the LM's token ids)
        argnums = (0, 1) if args.mode == "layer" else 0
        out[name] = (jax.jit(jax.value_and_grad(loss, argnums, has_aux=True)), (params, x))
    return out


def phases(args):
    """The routed capacity layer's parts on their own: ``{name: (jitted, arguments)}``,
    each forward and forward + backward."""
    import jax
    import jax.numpy as jnp

    from dew.nn import _moe_dispatch as d

    tokens, embed, f, num, k = args.tokens, args.embed, args.features, args.experts, args.k
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (tokens, embed))
    router = 0.02 * jax.random.normal(keys[1], (embed, num))
    gate, up = (0.02 * jax.random.normal(q, (num, embed, f)) for q in keys[2:4])
    down = 0.02 * jax.random.normal(keys[4], (num, f, embed))
    capacity = d.capacity_of(tokens, k, num, args.capacity_factor)

    def route(x, router):
        probs, weights, chosen = d.route(x @ router, k, "softmax_topk", None)
        balance = num * jnp.sum(jnp.mean(jax.nn.one_hot(chosen, num), (0, 1)) * probs.mean(0))
        return weights, chosen, balance

    weights, chosen, _ = route(x, router)
    plan = d.layout(chosen, num, capacity)
    buf = d.dispatch_rows(x, plan, k).reshape(num, capacity, embed)
    y = d.experts_batched(buf, gate, up, down, "swiglu").reshape(num * capacity, embed)
    parts = {
        "router (logits, top-k, balance)": (
            lambda x, r: jnp.sum(route(x, r)[0]) + route(x, r)[2],
            (x, router),
        ),
        "dispatch gather": (lambda x: jnp.sum(d.dispatch_rows(x, plan, k) ** 2), (x,)),
        "experts batched matmul": (
            lambda b, g, u, w: jnp.sum(d.experts_batched(b, g, u, w, "swiglu") ** 2),
            (buf, gate, up, down),
        ),
        "combine": (lambda y, w: jnp.sum(d.combine_rows(y, plan, w) ** 2), (y, weights)),
    }
    out = {
        "layout (sort, index maps), forward only": (
            jax.jit(lambda c: d.layout(c, num, capacity)),
            (chosen,),
        )
    }
    for name, (fn, arguments) in parts.items():
        out[f"{name}, forward"] = (jax.jit(fn), arguments)
        grad = jax.grad(fn, argnums=tuple(range(len(arguments))))
        out[f"{name}, forward + backward"] = (jax.jit(grad), arguments)
    return out


def interleaved(entries, repeats: int):
    """``{name: (wall, cpu)}`` seconds per call: medians over ``repeats`` rounds, each
    round one group of 3 calls of every entry in turn."""
    import jax

    for fn, arguments in entries.values():
        jax.block_until_ready(fn(*arguments))  # compile, warm
    walls = {n: [] for n in entries}
    cpus = {n: [] for n in entries}
    for _ in range(repeats):
        for name, (fn, arguments) in entries.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(3):
                out = fn(*arguments)
            jax.block_until_ready(out)
            walls[name].append((time.perf_counter() - wall) / 3)
            cpus[name].append((time.process_time() - cpu) / 3)
    return {n: (statistics.median(walls[n]), statistics.median(cpus[n])) for n in entries}


def main(argv=None) -> None:
    args = parse(argv)
    os.environ.pop("XLA_FLAGS", None)  # one CPU device
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax

    entries = programs(args)
    if args.phases:
        entries |= phases(args)
    costs = {n: cost(fn, a) for n, (fn, a) in entries.items()}
    load = os.getloadavg()[0]
    times = interleaved(entries, args.repeats)
    print(f"load average {load:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    what = (
        f"one layer, {args.tokens} tokens, embed {args.embed}"
        if args.mode == "layer"
        else f"the medium LM, {LM_BATCH} x {LM['max_seq_len']} tokens"
    )
    print(
        f"MoE step (fwd+bwd) on {jax.default_backend()}: {what}, {args.experts} experts of "
        f"width {args.features}, top-{args.k}; medians of {args.repeats} interleaved rounds"
    )
    bar_name = next(iter(entries))
    bar_wall, bar_cpu = times[bar_name]
    bar_flops = costs[bar_name][0]
    print(
        f"  {'':40s} {'wall ms':>8s} {'ratio':>6s} {'cpu ms':>8s} {'ratio':>6s} "
        f"{'GFLOP':>7s} {'ratio':>6s} {'MB moved':>9s}"
    )
    for name, (wall, cpu) in times.items():
        flops, moved = costs[name]
        ratios = (wall / bar_wall, cpu / bar_cpu, flops / bar_flops)
        print(
            f"  {name:40s} {wall * 1e3:8.2f} {ratios[0]:5.2f}x {cpu * 1e3:8.2f} {ratios[1]:5.2f}x "
            f"{flops / 1e9:7.3f} {ratios[2]:5.2f}x {moved / 1e6:9.1f}"
        )
    if "capacity" in args.runs:
        name = next(n for n in entries if n.startswith("MoE capacity, factor"))
        fn, arguments = entries[name]
        (_, sown), _ = fn(*arguments)
        fractions = [
            float(v.mean())
            for p, v in jax.tree_util.tree_leaves_with_path(sown)
            if any(getattr(q, "key", None) == "dropped_fraction" for q in p)
        ]
        print(
            f"  dropped at factor {args.capacity_factor:g}: "
            f"{statistics.mean(fractions):.2%} of assignments"
        )


if __name__ == "__main__":
    main()
