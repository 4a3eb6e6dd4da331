"""What a run does before its first step: the model's init is traced once (its
shapes, shardings and the compiled initialisation all come from that one trace;
tracing a large model takes seconds), and the initial state equals a direct
jitted initialisation bit for bit."""

from __future__ import annotations

import contextlib
import io
import itertools

import jax
import numpy as np
import optax

from dew.data import Dataset
from dew.nn import models
from dew.objectives.lm import LMObjective
from dew.train import Trainer
from dew.train.mesh import unbox_abstract


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
    objective = CountingLM(model, seq_len=8)
    trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(3), progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        state = trainer.fit(data, steps=1, log_every=0)
    assert CountingLM.traces == 1
    # sgd(0): the step leaves the weights as initialised
    spec = trainer._data_spec(data)
    with trainer._context():
        direct = jax.jit(lambda k: unbox_abstract(trainer._create(k, spec)))(trainer.key)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(direct.params)):
        np.testing.assert_array_equal(got, want)
