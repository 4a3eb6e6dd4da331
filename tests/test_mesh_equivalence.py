"""Several axes at once, through the umbrella API: a pipelined mixture-of-experts
model from the registry, trained with momentum SGD and gradient accumulation on
expert=2, tensor=2, stage=2 (8 devices), equals the same run on one device.

(The per-axis equivalences live in packages/dew-train/tests/test_mesh_equivalence.py.)
"""

import itertools
import json

import jax
import numpy as np
import optax
import pytest

from dew import Dataset, Trainer, models
from dew.objectives.lm import LMObjective
from dew.train import MeshSpec

SEQ, BATCH, VOCAB, STEPS = 16, 8, 64, 3
CONFIG = dict(vocab_size=VOCAB, emb_features=32, num_layers=2, num_heads=4, num_kv_heads=2,
              mlp_features=32, max_seq_len=SEQ, num_experts=4, experts_per_token=2,
              num_stages=2, pipeline_microbatches=2)


def run(mesh: MeshSpec, run_dir):
    rows = np.random.default_rng(1).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    data = Dataset(train=lambda p: iter({"text": r[p.slice(BATCH)]} for r in itertools.cycle(rows)),
                   val=None, records=STEPS * BATCH, batch=BATCH)
    model = models.build("causal_transformer", **CONFIG)
    trainer = Trainer(LMObjective(model, seq_len=SEQ), optax.sgd(0.5, momentum=0.9), key=jax.random.key(2),
                      mesh=mesh, accumulate=2, run_dir=str(run_dir))
    state = trainer.fit(data, steps=STEPS, log_every=1)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    return [(r["loss"], r["aux_loss"]) for r in train], jax.device_get(state.params)


@pytest.mark.slow
def test_expert_tensor_stage_together_match_one_device(tmp_path):
    want_metrics, want = run(MeshSpec(data=1, devices=jax.devices()[:1]), tmp_path / "one")
    got_metrics, got = run(MeshSpec(expert=2, tensor=2, stage=2), tmp_path / "eight")
    # float32 sums in another order across devices: rtol 1e-5
    np.testing.assert_allclose(got_metrics, want_metrics, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
