"""The Trainer against a hand-written jax/optax loop, on the 8-device mesh."""

import itertools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, Trainer

MODEL = CausalTransformer(
    vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=32, max_seq_len=16
)
ROWS = np.random.default_rng(0).integers(0, 32, (5, 8, 9)).astype(np.int32)


def data(rows=ROWS):
    return Dataset(
        train=lambda partition: iter({"text": r} for r in itertools.cycle(rows)),
        val=lambda partition: iter([{"text": rows[0]}, {"text": rows[1]}]),
        records=8 * len(rows),
        batch=rows.shape[1],
    )


def reference_losses(objective, optimizer, key, steps):
    """A plain single-device jax/optax loop with the same initialisation."""
    k_init, _ = jax.random.split(key)
    params = nn.unbox(objective.init(k_init))["params"]["policy"]
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: objective.loss({"params": {"policy": p}}, batch, None)[0].value
        )(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    with jax.default_device(jax.devices()[0]):
        for i in range(steps):
            params, opt_state, loss = step(params, opt_state, {"text": ROWS[i % len(ROWS)]})
            losses.append(float(loss))
    return losses, params


@pytest.mark.slow
def test_eight_devices_match_a_single_device_loop(capsys):
    objective = LMObjective(model=MODEL, seq_len=8)
    optimizer = optax.adam(1e-2)
    trainer = Trainer(objective, optimizer, key=jax.random.key(0))
    state = trainer.fit(data(), steps=6, log_every=1)
    out = capsys.readouterr().out
    assert (
        "Training from step 0 to 6 on {'data': 8, 'expert': 1, 'fsdp': 1, 'tensor': 1, "
        "'sequence': 1, 'stage': 1} (1 process(es))"
    ) in out
    logged = [
        float(line.split("loss ")[1].split(",")[0])
        for line in out.splitlines()
        if line.startswith("step ") and "loss" in line
    ]
    want, params = reference_losses(objective, optimizer, jax.random.key(0), 6)
    # float32 reductions in another order over 8 devices: agree to ~1e-5 relative.
    np.testing.assert_allclose(logged, want, rtol=2e-4)  # logged with 4 decimals
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
        jax.device_get(state.params),
        jax.device_get(params),
    )
    assert (int(state.step), int(state.microstep), int(state.updates)) == (6, 6, 6)
    assert "Goodput: first step after" in out
    assert len(state.params["layers"]["mlp"]["up"]["kernel"].sharding.device_set) == 8

    metrics = trainer.evaluate(state, data())
    rows = ROWS[:2].reshape(16, 9)
    logits = MODEL.apply({"params": jax.device_get(state.params)}, rows[:, :-1])
    logp = jax.nn.log_softmax(logits, -1)
    nll = -np.take_along_axis(np.asarray(logp), rows[:, 1:, None], -1)
    assert metrics["loss"] == pytest.approx(float(nll.mean()), rel=1e-4)


def test_batch_that_does_not_divide_over_devices_is_refused_before_compiling():
    objective = LMObjective(model=MODEL, seq_len=8)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    bad = Dataset(train=lambda p: iter([]), val=None, records=12, batch=12)
    with pytest.raises(ValueError, match="global batch 12 does not divide over 8 data-parallel"):
        trainer.fit(bad, steps=1)


def test_wrong_row_length_is_refused_with_the_shape():
    objective = LMObjective(model=MODEL, seq_len=8)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0))
    short = Dataset(
        train=lambda p: itertools.repeat({"text": ROWS[0, :, :6]}), val=None, records=8, batch=8
    )
    with pytest.raises(ValueError, match=r"shape \(8, 6\).*seq_len \+ 1 = 9"):
        trainer.fit(short, steps=1)


def test_mesh_product_mismatch_names_devices():
    with pytest.raises(ValueError, match="needs 4 devices but 8 are present"):
        MeshSpec(data=2, tensor=2).sizes(8)
    assert MeshSpec(fsdp=4).sizes(8) == {
        "data": 2,
        "expert": 1,
        "fsdp": 4,
        "tensor": 1,
        "sequence": 1,
        "stage": 1,
    }


def test_eval_every_logs_evaluation_and_a_preview(capsys):
    rows = np.tile(np.arange(9, dtype=np.int32), (2, 8, 1))
    ids = type(
        "Ids",
        (),
        {"encode": lambda self, s: [0, 1], "decode": lambda self, ids: ",".join(map(str, ids))},
    )()
    objective = LMObjective(
        model=MODEL, seq_len=8, preview_prompt="", preview_tokens=4, tokenizer=ids
    )
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(0))
    state = trainer.fit(data(rows), steps=30, log_every=30, eval_every=30)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("eval step 30: "))
    assert "perplexity" in line and "accuracy" in line
    reported = float(line.split("loss ")[1].split(",")[0])
    assert reported == pytest.approx(trainer.evaluate(state, data(rows))["loss"], abs=1e-4)
    # the model learned "i -> i + 1"; its greedy preview continues 0, 1 with 2, 3, 4, 5
    assert "preview step 30: '0,1,2,3,4,5'" in out


def test_data_that_ends_before_steps_ends_the_run_with_a_checkpoint(tmp_path, capsys):
    """A reader that ends (Mixture(exhausted='stop')) ends the run at its last batch:
    the result says so, the log too, and the end-of-run checkpoint holds that step."""
    from dew.train import Checkpoints

    three = Dataset(
        train=lambda partition: iter({"text": r} for r in ROWS[:3]),
        val=None,
        records=8 * 3,
        batch=ROWS.shape[1],
    )
    objective = LMObjective(MODEL, seq_len=8)
    checkpoints = Checkpoints(str(tmp_path / "ckpt"))
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0), checkpoints=checkpoints)
    state = trainer.fit(three, steps=10, log_every=0)
    assert int(state.step) == 3
    assert trainer.result.reason == "data_exhausted" and trainer.result.step == 3
    assert "ended after step 3 of 10" in trainer.result.detail
    assert "Stopped at step 3: the training data ended" in capsys.readouterr().out
    assert checkpoints.steps()[-1] == 3
