"""Dew's Trainer.fit against a hand-written jax/flax/optax loop, side by side.

Same model, same optimizer, same batches, same process and allocator
setting; the two sides alternate and each number is the median of
``--repeats`` runs. Reports steady-state tokens/s and time to the first
step (init + compile + one step), as ratios Dew / hand-written.

    python tools/bench_train.py                 # seed and medium sizes
    python tools/bench_train.py --sizes seed --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
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

from dew import Dataset, Trainer, models  # noqa: E402
from dew.objectives.language.lm import LMObjective  # noqa: E402

SIZES = {
    "seed": dict(emb_features=64, num_layers=2, num_heads=4, mlp_features=256, seq_len=64, batch=8),
    "medium": dict(
        emb_features=256, num_layers=4, num_heads=8, mlp_features=1024, seq_len=256, batch=16
    ),
}
VOCAB = 264


def make(size):
    cfg = dict(SIZES[size])
    seq_len, batch = cfg.pop("seq_len"), cfg.pop("batch")
    model = models.build("causal_transformer", vocab_size=VOCAB, max_seq_len=seq_len, **cfg)
    rows = np.random.default_rng(0).integers(0, 256, (4, batch, seq_len + 1)).astype(np.int32)
    return model, seq_len, batch, rows


def run_dew(size, steps):
    model, seq_len, batch, rows = make(size)
    data = Dataset(
        train=lambda p: ({"text": r} for r in itertools.cycle(rows)),
        val=None,
        records=batch * 4,
        batch=batch,
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=seq_len),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        progress=False,
    )
    return fit_seconds(trainer, data, steps)


def run_hand(size, steps):
    model, seq_len, batch, rows = make(size)
    optimizer = optax.adamw(3e-3)
    start = time.perf_counter()

    @jax.jit
    def init(key):
        params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]
        params = jax.tree.map(
            lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value")
        )
        return params, optimizer.init(params)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1))

    def advance(state, i):
        params, opt_state, _ = state
        return step(params, opt_state, jnp.asarray(rows[i % len(rows)]))

    return loop_seconds(start, advance, (*init(jax.random.key(0)), None), steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s), jax {jax.__version__}; steps {args.steps}, "
        f"median of {args.repeats}"
    )
    for size in args.sizes:
        _, seq_len, batch, _ = make(size)
        dew, hand = [], []
        for r in range(args.repeats):
            order = [(run_dew, dew), (run_hand, hand)]
            for fn, out in order if r % 2 == 0 else order[::-1]:
                out.append(fn(size, args.steps))
        d_first = statistics.median(x[0] for x in dew)
        h_first = statistics.median(x[0] for x in hand)
        d_step = statistics.median(x[1] for x in dew)
        h_step = statistics.median(x[1] for x in hand)
        tokens = batch * seq_len
        print(
            f"{size}: tokens/s dew {tokens / d_step:,.0f} hand {tokens / h_step:,.0f} "
            f"ratio {h_step / d_step:.3f}; first step dew {d_first:.2f} s hand "
            f"{h_first:.2f} s ratio {d_first / h_first:.2f}"
        )


if __name__ == "__main__":
    main()
