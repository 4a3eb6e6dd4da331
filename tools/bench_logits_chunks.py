"""One LMObjective training step with the whole logits against logits in chunks.

For each vocabulary and ``logits_chunk_size`` (``none`` = the whole logits), one
jitted ``value_and_grad`` of ``LMObjective.loss`` + ``optax.adamw`` on a tiny
``CausalTransformer`` (width 64, 2 layers), params and optimizer state donated:
the compiled step's temporaries (``memory_analysis().temp_size_in_bytes``) and
the median step time over ``--steps`` steps after a warm-up, alternating the
variants over ``--repeats`` rounds so a busy machine slows each alike.

    uv run --locked python tools/bench_logits_chunks.py --vocab 256 8192 --chunks none 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.nn import CausalTransformer
from dew.objectives import Step
from dew.objectives.language.lm import LMObjective


def build(vocab: int, chunk: int | None, batch: int, seq: int):
    model = CausalTransformer(
        vocab_size=vocab, emb_features=64, num_layers=2, num_heads=4, mlp_features=256,
        max_seq_len=seq,
    )  # fmt: skip
    objective = LMObjective(model=model, seq_len=seq, logits_chunk_size=chunk)
    params = nn.unbox(objective.init(jax.random.key(0)))["params"]
    optimizer = optax.adamw(1e-3)
    step = Step(index=jnp.int32(0), key=jax.random.key(1))

    def train(params, opt_state, batch):
        def loss(p):
            return objective.loss({"params": p}, batch, step)[0].value

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    tokens = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    data = {"text": jnp.asarray(tokens)}
    state = (params, optimizer.init(params))
    compiled = jax.jit(train, donate_argnums=(0, 1)).lower(*state, data).compile()
    return compiled, state, data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[256, 8192])
    parser.add_argument("--chunks", nargs="+", default=["none", "64"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for vocab in args.vocab:
        runs = {}
        for name in args.chunks:
            chunk = None if name == "none" else int(name)
            compiled, state, data = build(vocab, chunk, args.batch, args.seq)
            temp = compiled.memory_analysis().temp_size_in_bytes
            state = compiled(*state, data)[:2]  # warm
            runs[name] = [compiled, state, data, temp, []]
        for _ in range(args.repeats):
            for run in runs.values():
                compiled, state, data, _, times = run
                for _ in range(args.steps):
                    start = time.perf_counter()
                    *state, value = compiled(*state, data)
                    value.block_until_ready()
                    times.append(time.perf_counter() - start)
                run[1] = tuple(state)
        base = statistics.median(runs[args.chunks[0]][4])
        for name, (_, _, _, temp, times) in runs.items():
            median = statistics.median(times)
            print(
                f"vocab {vocab:6d} batch {args.batch} seq {args.seq} chunk {name:>5}: "
                f"temporaries {temp / 2**20:7.1f} MiB, step {median * 1e3:7.2f} ms "
                f"({median / base:.2f}x {args.chunks[0]})"
            )


if __name__ == "__main__":
    main()
