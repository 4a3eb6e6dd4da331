"""One mixture-of-experts layer's training step (forward and backward, jitted)
under each dispatch of :class:`dew.nn.MoE`, side by side in one process, with a
dense SwiGLU MLP of the same active parameters (width ``k * features``) as the bar:

- ``dense``: every expert on every token (the reference);
- ``capacity`` dropless (``[expert, tokens, embed]`` buckets: as dense) and with
  ``--capacity-factor`` (the fast CPU path; it drops what overflows);
- ``blocked``: dropless, sorted by expert and padded to blocks, one batched matmul;
- ``ragged``: ``jax.lax.ragged_dot`` (XLA:CPU lowers it to a dense masked product).

Each figure is the best of ``--repeats`` groups of 3 steps, in ms, and its ratio to
the dense MLP; the dropped fraction of the capacity run is printed.

    python tools/bench_moe.py
    python tools/bench_moe.py --experts 32 --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--features", type=int, default=512, help="each expert's width")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.tokens, args.embed, args.features, args.experts, args.k, args.repeats) < 1:
        parser.error("--tokens, --embed, --features, --experts, --k and --repeats must be >= 1")
    if args.k > args.experts or args.capacity_factor <= 0:
        parser.error(f"need 1 <= --k ({args.k}) <= --experts ({args.experts}) and a factor > 0")
    os.environ.pop("XLA_FLAGS", None)  # one CPU device

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from dew.nn import MLP, MoE

    x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.embed))  # one row
    common = dict(num_experts=args.experts, experts_per_token=args.k, features=args.features)
    runs = {
        "dense MLP, same active params": MLP(features=args.k * args.features),
        "MoE dense dispatch": MoE(dispatch="dense", **common),
        "MoE capacity, dropless": MoE(dispatch="capacity", **common),
        f"MoE capacity, factor {args.capacity_factor:g}": MoE(
            dispatch="capacity", capacity_factor=args.capacity_factor, **common
        ),
        "MoE blocked, dropless": MoE(dispatch="blocked", **common),
        "MoE ragged_dot, dropless": MoE(dispatch="ragged", **common),
    }
    times, dropped = {}, None
    for name, module in runs.items():
        params = nn.unbox(module.init(jax.random.key(1), x)["params"])

        def loss(p, x, module=module):
            y, sown = module.apply({"params": p}, x, mutable=["intermediates"])
            return jnp.mean(y**2), sown

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, sown), _ = step(params, x)
        if "dropped_fraction" in sown.get("intermediates", {}):
            dropped = float(sown["intermediates"]["dropped_fraction"][0])
        times[name] = _timing.best_of(
            lambda step=step, params=params: step(params, x),
            jax.block_until_ready,
            warm=1,
            repeats=args.repeats,
            calls=3,
        )
    bar = times["dense MLP, same active params"]
    print(
        f"MoE layer step (fwd+bwd) on {jax.default_backend()}: {args.tokens} tokens, embed "
        f"{args.embed}, {args.experts} experts of width {args.features}, top-{args.k}"
    )
    for name, seconds in times.items():
        print(f"  {name:34s} {seconds * 1e3:9.1f} ms  {seconds / bar:6.2f}x the dense MLP")
    print(f"  dropped at factor {args.capacity_factor:g}: {dropped:.2%} of assignments")


if __name__ == "__main__":
    main()
