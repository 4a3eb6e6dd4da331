"""JAX sides of the peer suite, one per process (install: the workspace venv, ``.venv``):

- ``dew``: ``Trainer.fit`` on a ``CausalTransformer`` configured as the GPT-2-style
  network of tools/bench_model.py (LayerNorm, GELU, learned positions, biases);
  greedy generation with ``dew.sampling.generate`` (KV cache) on the trained weights;
- ``dew_llama``: the same with ``models.build("causal_transformer", ...)`` defaults
  (RMSNorm, RoPE, SwiGLU, no biases): the Dew side the Llama-style peers
  (Tunix, MaxText, Levanter's Llama) are compared with;
- ``hand``: that plain linen GPT-2 in a hand-written jitted loop with donation,
  optax adamw; greedy generation is the loop a user writes for a model without a
  KV cache: a ``fori_loop`` that reruns the causal model over a fixed buffer.

    python tools/bench_peers/jax_sides.py --side dew --size medium --steps 10

Prints one line ``RESULT {json}`` (tools/bench_peers/protocol.py); all sides
run under Dew's default allocator setting (dew.nn.allocator).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bench_model  # noqa: E402  (applies Dew's allocator setting first)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import protocol  # noqa: E402

from dew import Dataset, Trainer  # noqa: E402
from dew.objectives.language.lm import LMObjective  # noqa: E402
from dew.sampling import Sampling, generate  # noqa: E402

SIDES = ("dew", "dew_llama", "hand")


def dew_trainer(size: str, variant: str) -> tuple[Trainer, Dataset]:
    """The trainer and dataset of a Dew side: ``bench_model.network(variant, size)``
    under ``LMObjective``, adamw(3e-3), the suite's random token rows."""
    s = protocol.SIZES[size]
    model = bench_model.network(variant, size)
    rows = protocol.rows(size)
    data = Dataset(
        train=lambda p: ({"text": r} for r in itertools.cycle(rows)),
        val=None,
        records=len(rows) * s["batch"],
        batch=s["batch"],
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=s["seq"]),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        progress=False,
    )
    return trainer, data


def run_dew(size: str, steps: int, variant: str) -> dict:
    trainer, data = dew_trainer(size, variant)
    model = trainer.objective.model
    # One fit of N steps, timed as every side is: the clocks start when step 1's
    # result is ready (fit waits for the first step) and stop when step N's is.
    marks = {}

    def after_first(info):
        if info.step == 1:
            jax.block_until_ready(info.state.params)
            marks["first"] = time.perf_counter() - START
            marks["clock"] = protocol.Clock()

    trainer.add_hook(after_first, name="bench clock")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = trainer.fit(data, steps=steps, log_every=0)
        jax.block_until_ready(state.params)
    first = marks["first"]
    wall, cpu = marks["clock"].per(steps - 1)
    prompts = protocol.prompts(size).tolist()
    greedy = Sampling(temperature=0)

    def sample():
        return generate(model, state.params, prompts, protocol.NEW_TOKENS, jax.random.key(0),
                        sampling=greedy).tokens  # fmt: skip

    return protocol.result(size, first, wall, cpu, protocol.warm_generation(sample))


def run_hand(size: str, steps: int) -> dict:
    entry = list(bench_model.build("plain", size))
    bench_model.timed(entry, 1)
    first = time.perf_counter() - START
    wall, cpu = bench_model.timed(entry, max(steps - 1, 1))
    model, params = bench_model.network("plain", size), entry[1]
    prompts = jnp.asarray(protocol.prompts(size))

    @jax.jit
    def sample(params, prompts):
        batch, length = prompts.shape
        buffer = jnp.zeros((batch, length + protocol.NEW_TOKENS), jnp.int32)
        buffer = buffer.at[:, :length].set(prompts)

        def body(i, buffer):  # causal: positions right of length+i-1 do not matter
            logits = model.apply({"params": params}, buffer)
            token = jnp.argmax(logits[:, length + i - 1], -1).astype(jnp.int32)
            return buffer.at[:, length + i].set(token)

        return jax.lax.fori_loop(0, protocol.NEW_TOKENS, body, buffer)[:, length:]

    rate = protocol.warm_generation(lambda: np.asarray(sample(params, prompts)))
    return protocol.result(size, first, wall, cpu, rate, note="generation uncached")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", required=True, choices=SIDES)
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    protocol.check_size(args.size)
    if args.side == "hand":
        result = run_hand(args.size, args.steps)
    else:
        result = run_dew(args.size, args.steps, "dew_gpt2" if args.side == "dew" else "dew_seed")
    protocol.emit(args.side, result)


if __name__ == "__main__":
    main()
