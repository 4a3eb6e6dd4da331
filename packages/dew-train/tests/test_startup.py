"""What a run does before its first step: the model's init is traced once (its
shapes, shardings and the compiled initialisation all come from that one trace;
tracing a large model takes seconds), and the initial state equals a direct
jitted initialisation bit for bit."""

from __future__ import annotations

import contextlib
import io
import itertools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import models
from dew.objectives.language.lm import LMObjective
from dew.train import Trainer
from dew.train.mesh import unbox_abstract
from dew.train.trainer import INIT_CPU_OPTIONS


class CountingLM(LMObjective):
    traces = 0

    def init(self, key, **kwargs):
        type(self).traces += 1
        return super().init(key, **kwargs)


def test_fit_traces_the_init_once_and_initialises_as_a_direct_jit():
    model = models.build(
        "causal_transformer", vocab_size=32, max_seq_len=8, emb_features=8, num_layers=1,
        num_heads=1, mlp_features=16,
    )  # fmt: skip
    rows = np.random.default_rng(0).integers(0, 32, (2, 8, 9)).astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": r} for r in itertools.cycle(rows)), val=None, records=16, batch=8
    )
    objective = CountingLM(model=model, seq_len=8)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(3), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=1, log_every=0)
    assert CountingLM.traces == 1
    # sgd(0): the step leaves the weights as initialised
    programs, spec = trainer.programs, dict(data.spec) if data.spec else None
    with programs.context():
        direct = jax.jit(lambda k: unbox_abstract(programs.create(k, spec)))(trainer.key)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(direct.params)):
        np.testing.assert_array_equal(got, want)


def _init_inputs(name):
    from dew.nn.testing import TINY_VIT

    if name in ("llama", "gpt2"):
        extra = {} if name == "llama" else dict(
            norm="layer", mlp_activation="gelu", position_embedding="learned", use_bias=True
        )  # fmt: skip
        model = models.build(
            "causal_transformer", vocab_size=40, max_seq_len=16, emb_features=16, num_layers=2,
            num_heads=2, mlp_features=32, **extra,
        )  # fmt: skip
        return model, (jnp.zeros((1, 16), jnp.int32),), {}
    if name == "vit":
        return models.build("vit", **TINY_VIT), (jnp.zeros((1, 12, 12, 3)),), {}
    model = models.build(
        "dit", sample_size=8, patch_size=2, in_channels=3, emb_features=16, num_layers=2,
        num_heads=2, mlp_features=24, num_classes=5, learn_sigma=True,
    )  # fmt: skip
    return model, (jnp.zeros((1, 8, 8, 3)), jnp.zeros((1,))), {"label": jnp.zeros((1,), jnp.int32)}


def xla_cpu_defaults() -> dict:
    """compiler_options restoring XLA's defaults (xla/debug_options_flags.cc) for each
    setting this process's XLA_FLAGS changes (CI compiles faster: noxfile.py
    CI_XLA_FLAGS): this test is about what users get."""
    defaults = {
        "xla_backend_optimization_level": 3,
        "xla_cpu_use_fusion_emitters": True,
        "xla_cpu_parallel_codegen_split_count": 32,
    }
    flags = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in defaults.items() if f"--{name}=" in flags}


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit", "dit"])
def test_init_compiled_at_o1_equals_the_default_bit_for_bit(name):
    """The trainer compiles the initialisation with INIT_CPU_OPTIONS on a CPU (faster to
    compile); the initial values must not move: every family's random initialisers
    (normal, truncated normal, uniform, zeros; dense, convolution, embedding) at O1
    against XLA's default."""
    model, args, kwargs = _init_inputs(name)

    def init(key):
        return nn.unbox(model.init(key, *args, **kwargs))

    key = jax.random.key(7)
    default = jax.jit(init, compiler_options=xla_cpu_defaults())(key)
    fast = jax.jit(init, compiler_options=xla_cpu_defaults() | INIT_CPU_OPTIONS)(key)
    pairs = list(zip(jax.tree.leaves(fast), jax.tree.leaves(default), strict=True))
    assert len(pairs) > 5
    for got, want in pairs:
        np.testing.assert_array_equal(got, want)
