"""Levanter side of the peer suite: Levanter's own ``Gpt2LMHeadModel`` (haliax
named tensors, equinox) at the suite's width and depth, its own
``compute_loss``, one training step written with its APIs (``haliax.named_jit``
with the model and optimizer state donated, ``equinox.filter_value_and_grad``,
optax adamw): Levanter's ``Trainer`` needs a tracker (wandb), a checkpointer and
its data-store configuration, which a CPU benchmark does not have, so its
step is rebuilt from the same parts. Gradient checkpointing off (the other
sides do not recompute). Levanter 1.1 (the newest on PyPI) has no KV-cache
generation: greedy generation is a ``fori_loop`` rerunning the model over a
fixed buffer, as a user of it writes.

Install (outside the repository; Levanter 1.1 (Oct 2023) imports jax internals that
later jax removed, so jax 0.4.19 and numpy 1 are pinned):

    uv venv -p /root/.pyenv/versions/3.11.7/bin/python3 /work/peers/levanter
    VIRTUAL_ENV=/work/peers/levanter uv pip install levanter==1.1 haliax==1.3 \\
        "jax[cpu]==0.4.19" jaxlib==0.4.19 equinox==0.11.2 jaxtyping==0.2.25 optax==0.1.7 \\
        "numpy<2" "chex<0.1.86" "scipy<1.13" "ml-dtypes<0.4" "pyarrow<16" "pandas<2.2"

    /work/peers/levanter/bin/python tools/bench_peers/levanter_side.py --size seed

Rows are ``seq + 1`` tokens (its loss predicts tokens 2..L of its input, so
``seq`` targets per row as on every other side). Prints ``RESULT {json}``.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import protocol  # noqa: E402
from levanter.models.gpt2 import Gpt2Config, Gpt2LMHeadModel  # noqa: E402
from levanter.models.lm_model import LmExample  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    protocol.check_size(args.size)
    s = protocol.SIZES[args.size]
    config = Gpt2Config(
        seq_len=s["seq"] + 1, hidden_dim=s["emb"], num_layers=s["layers"], num_heads=s["heads"],
        mlp_scale=s["mlp"] // s["emb"], layer_norm_epsilon=1e-6, gradient_checkpointing=False,
    )  # fmt: skip
    Vocab = hax.Axis("vocab", protocol.VOCAB)
    Batch = hax.Axis("batch", s["batch"])
    model = Gpt2LMHeadModel.init(Vocab, config, key=jax.random.PRNGKey(0))
    optimizer = optax.adamw(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, tokens):
        tokens = hax.named(tokens, (Batch, config.Pos))
        example = LmExample(tokens=tokens, loss_mask=hax.ones((Batch, config.Pos)))
        return model.compute_loss(example).scalar()

    @hax.named_jit(donate_args=(True, True, False))
    def step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    rows = [jnp.asarray(r) for r in protocol.rows(args.size)]
    model, opt_state, loss = step(model, opt_state, rows[0])
    jax.block_until_ready(loss)
    first = time.perf_counter() - START
    clock = protocol.Clock()
    for i in range(1, args.steps):
        model, opt_state, loss = step(model, opt_state, rows[i % len(rows)])
    jax.block_until_ready((model, loss))
    wall, cpu = clock.per(args.steps - 1)
    assert np.isfinite(float(loss))

    Gen = hax.Axis("batch", protocol.GEN_BATCH)

    @hax.named_jit
    def sample(model, prompts):
        length = prompts.shape[1]
        buffer = jnp.zeros((protocol.GEN_BATCH, config.seq_len), jnp.int32)
        buffer = buffer.at[:, :length].set(prompts)

        def body(i, buffer):  # causal: positions right of length+i-1 do not matter
            logits = model(hax.named(buffer, (Gen, config.Pos))).array
            token = jnp.argmax(logits[:, length + i - 1], -1).astype(jnp.int32)
            return buffer.at[:, length + i].set(token)

        out = jax.lax.fori_loop(0, protocol.NEW_TOKENS, body, buffer)
        return out[:, length : length + protocol.NEW_TOKENS]

    prompts = jnp.asarray(protocol.prompts(args.size))
    rate = protocol.warm_generation(lambda: np.asarray(sample(model, prompts)))
    note = "own step (not its Trainer); tied head; generation uncached over seq"
    protocol.emit("levanter", protocol.result(args.size, first, wall, cpu, rate, note=note))


if __name__ == "__main__":
    main()
