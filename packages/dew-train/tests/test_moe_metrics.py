"""A mixture of experts' diagnostics reach metrics.jsonl and the log line:
``moe_dropped_fraction`` and ``moe_z_loss`` of one step at ``accumulate=2``
are the row-weighted means of the objective's metrics on the two microbatches
(rows ``j, j + 2, ...``), each of which drops against its own capacity.
Tolerance: 1e-6 relative (float32 sums in another order)."""

import itertools
import json

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_MOE
from dew.objectives import Step
from dew.objectives.contract import weighted
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, Trainer

SEQ, ROWS, ACCUMULATE = 8, 8, 2
MODEL = CausalTransformer(
    **TINY_MOE, moe_dispatch="capacity", moe_capacity_factor=1.0, init_std=0.5
)


@pytest.mark.slow
def test_fit_logs_the_dropped_fraction_and_z_loss_of_its_microbatches(tmp_path, capsys):
    text = np.random.default_rng(1).integers(0, TINY_MOE["vocab_size"], (ROWS, SEQ + 1))
    batch = {"text": text.astype(np.int32)}
    objective = LMObjective(model=MODEL, seq_len=SEQ)
    data = Dataset(train=lambda p: itertools.repeat(batch), val=None, records=ROWS, batch=ROWS)
    trainer = Trainer(
        objective,
        optax.sgd(0.1),
        key=jax.random.key(0),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        accumulate=ACCUMULATE,
        run_dir=str(tmp_path),
        progress=False,
    )
    trainer.fit(data, steps=1, log_every=1)
    record = next(
        r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if r["kind"] == "train"
    )

    # the same parameters the trainer starts from, the same microbatches
    k_init, _ = jax.random.split(jax.random.key(0))
    variables = nn.unbox(jax.jit(objective.init)(k_init))
    step = Step(index=0, key=jax.random.key(0))
    parts = [
        jax.jit(objective.loss)(variables, {"text": batch["text"][j::ACCUMULATE]}, step)[1]
        for j in range(ACCUMULATE)
    ]
    want = weighted.to_float(weighted.add(*parts))
    assert 0 < want["moe_dropped_fraction"] < 0.5  # some assignments dropped
    for name in ("aux_loss", "moe_z_loss", "moe_dropped_fraction"):
        assert record[name] == pytest.approx(want[name], rel=1e-6), name

    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step 1:")]
    head = line.split(", ")  # "step 1: loss 3.4, aux_loss 1.4, moe_dropped_fraction 0.2, ..."
    assert head[1].startswith("aux_loss ") and head[2].startswith("moe_dropped_fraction "), line
