"""MDLM and BD3-LM trained through the Trainer: five optax.sgd steps on
data=2,fsdp=2,tensor=2 (8 devices), and BD3-LM on data=4,sequence=2 (its block mask
under sequence sharding), give the one-device run's losses and parameters.

Every draw (times per row or per (row, block), masking uniforms) is a function of the
step and the row's index in the whole batch (``Step.row_keys``, antithetic offsets over
the whole batch), so the draws agree however the batch is split (tests/
test_family_contract.py checks accumulate 2 and 4 as well).
Tolerance: float32 sums in another order across devices, rtol 1e-5 (and 1e-5 of each
array's largest entry for parameters near zero: one entry of -0.0018 in an array of
scale 0.65 differed by 1.02e-6 with the per-row draws).
"""

import dataclasses
import itertools
import json

import jax
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import Transformer
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.diffusion.masked import MaskedDiffusionObjective
from dew.train import MeshSpec, Trainer

L, BATCH, STEPS, V, MASK = 8, 8, 5, 8, 7
MODEL = Transformer(
    vocab_size=V, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=L
)
ROWS = np.random.default_rng(0).integers(0, MASK, (STEPS, BATCH, L)).astype(np.int32)


def run(objective, mesh, run_dir):
    data = Dataset(
        train=lambda p: iter({"text": r[p.slice(BATCH)]} for r in itertools.cycle(ROWS)),
        val=None,
        records=STEPS * BATCH,
        batch=BATCH,
    )
    trainer = Trainer(
        objective, optax.sgd(0.5), key=jax.random.key(0), mesh=mesh, run_dir=str(run_dir),
        progress=False,
    )  # fmt: skip
    state = trainer.fit(data, steps=STEPS, log_every=1)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in records if r["kind"] == "train"], jax.device_get(state.params)


MAKE = {
    "mdlm": lambda: MaskedDiffusionObjective(model=MODEL, mask_id=MASK, seq_len=L, ema=None),
    "bd3": lambda: BlockDiffusionObjective(
        model=MODEL, mask_id=MASK, seq_len=L, block_size=2, ema=None
    ),
}
_ONE_DEVICE = {}


def one_device(kind, tmp_path):
    """The one-device run of ``kind``, shared by the meshes compared with it."""
    if kind not in _ONE_DEVICE:
        mesh = MeshSpec(data=1, devices=jax.devices()[:1])
        _ONE_DEVICE[kind] = run(MAKE[kind](), mesh, tmp_path / "one")
    return _ONE_DEVICE[kind]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, mesh",
    [
        ("mdlm", dict(data=2, fsdp=2, tensor=2)),
        ("bd3", dict(data=2, fsdp=2, tensor=2)),
        # the [noisy | clean] rows of 2L tokens split over sequence=2: the halves sit
        # on different devices, and attention takes the dense block-diffusion mask
        ("bd3", dict(data=4, sequence=2)),
    ],
    ids=["mdlm", "bd3", "bd3-sequence"],
)
def test_eight_devices_train_as_one(kind, mesh, tmp_path):
    want_losses, want = one_device(kind, tmp_path)
    got_losses, got = run(MAKE[kind](), MeshSpec(**mesh), tmp_path / "eight")
    assert all(np.isfinite(want_losses)) and want_losses[0] > 0
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    # an entry near zero moves by float32 ulps of its array's scale, not of itself
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
        got,
        want,
    )


# a width no other test builds, so nothing of this model is in the in-process caches
_FRESH = Transformer(
    vocab_size=V, emb_features=24, num_layers=1, num_heads=2, mlp_features=40, max_seq_len=L
)


@pytest.mark.parametrize(
    "value, message",
    [
        (MASK, r"batch\['text'\] holds the mask id 7 as data \(row 1, 1 rows in all\)"),
        (V + 2, r"holds token id 10 outside .*vocabulary \(vocab_size 8, largest id 10"),
    ],
    ids=["mask-id", "beyond-vocab"],
)
def test_bad_values_are_refused_before_anything_is_compiled(value, message, tmp_path):
    """The first batch's values (the mask id in the data, an id beyond the vocabulary)
    are checked before the state's creation compiles: no compilation event at all."""
    events = []

    def listen(event, seconds, **kw):
        if event.startswith(("/jax/core/compile/backend_compile", "/jax/compilation_cache/")):
            events.append(event)

    bad = ROWS[0].copy()
    bad[1, 3] = value
    data = Dataset(
        train=lambda p: iter(itertools.repeat({"text": bad[p.slice(BATCH)]})),
        val=None, records=STEPS * BATCH, batch=BATCH,
    )  # fmt: skip
    objective = MaskedDiffusionObjective(model=_FRESH, mask_id=MASK, seq_len=L, ema=None)
    trainer = Trainer(
        objective, optax.sgd(0.5), key=jax.random.key(0), run_dir=str(tmp_path), progress=False,
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
    )  # fmt: skip
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with pytest.raises(ValueError, match=message) as error:
            trainer.fit(data, steps=2, log_every=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events == [], (events, str(error.value))
    # the control: the same run on good rows compiles (the listener does hear it)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        good = dataclasses.replace(data, train=lambda p: iter(itertools.repeat({"text": ROWS[0]})))
        trainer.fit(good, steps=1, log_every=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events
