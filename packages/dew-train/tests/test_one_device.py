"""The trainer's context on a mesh of one device leaves the model's activation
constraints out, as a plain loop has none; on a mesh of two it keeps them. On a
TPU a constraint inside a scanned layer is a value of its own that the backward
pass stores (docs/performance.md, "On a TPU v5e chip": 144.8 against 132.6 ms a
step of the GPT-2 of tools/bench_tpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec
from dew.train._programs import Programs
from dew.train.mesh import DEFAULT_RULES

SEQ = 8


def constraints_traced(devices: int) -> int:
    model = CausalTransformer(
        vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=48,
        max_seq_len=SEQ,
    )  # fmt: skip
    tokens = jnp.zeros((devices * 2, SEQ), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    programs = Programs(
        objective=LMObjective(model=model, seq_len=SEQ),
        optimizer=optax.adam(1e-3),
        mesh=MeshSpec(data=devices, devices=jax.devices()[:devices]),
        rules=DEFAULT_RULES,
    )
    with programs.context():
        jaxpr = jax.make_jaxpr(lambda p, t: model.apply({"params": p}, t))(params, tokens)
    return str(jaxpr).count("sharding_constraint")


def test_one_device_traces_no_constraint():
    assert constraints_traced(1) == 0


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (XLA_FLAGS)")
def test_two_devices_keep_the_constraints():
    assert constraints_traced(2) > 0
