"""Tracing a model compiles nothing: the default attention mask (positions
0..length-1, nothing padded) is a numpy constant of the program, not a chain
of eager jax ops that each compile a program of their own at startup (there
were 14, about a second before the first step)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import models


class Compiles(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        # a compile, or a program read back from the persistent compilation cache
        for start in ("Finished XLA compilation of ", "Persistent compilation cache hit for "):
            if message.startswith(start):
                self.names.append(message[len(start) :].split(" ")[0].strip("'"))


def test_lowering_the_model_compiles_no_eager_ops():
    model = models.build(
        "causal_transformer", vocab_size=32, max_seq_len=8, emb_features=8, num_layers=1,
        num_heads=1, mlp_features=16,
    )  # fmt: skip
    key = jax.random.key(0)
    tokens = np.zeros((2, 8), np.int32)
    handler = Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            jax.jit(model.init).lower(key, tokens)
            variables = jax.eval_shape(model.init, key, tokens)
            jax.jit(model.apply).lower(variables, tokens)

            # the check sees a compile when there is one
            def probe_program(x):
                return jnp.abs(x - 7)

            jax.jit(probe_program)(np.ones(3, np.float32)).block_until_ready()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [n for n in handler.names if "probe_program" not in n] == []
    assert any("probe_program" in n for n in handler.names), handler.names
