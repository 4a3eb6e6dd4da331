"""Data-parallel splitting on the CPU (dew.train.cpu_split): the device count Dew asks
for at import and when it must not, the trainer's choice per run, and the split run
equal to the one-device run. Each case needs a fresh process whose JAX has not
started (and no XLA_FLAGS device count, which this test session sets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from dew import Dataset, MeshSpec, Trainer, models
from dew.objectives.lm import LMObjective
from dew.train import cpu_split
from dew.train.throughput import available_cores

CORES = available_cores()


def run(program: str, *argv: str, **env: str) -> dict:
    """Run ``program`` with ``argv`` in a fresh interpreter (no XLA_FLAGS, no
    DEW_CPU_DEVICES, plus ``env``); it prints one JSON line last."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", cpu_split.ENV)}
    done = subprocess.run(
        [sys.executable, "-c", program, *argv],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


IMPORT = """
import json, sys
early = sys.argv[-1] == "early"
import jax
if early:
    jax.devices()
import dew.train
from dew.train import cpu_split
import os
print(json.dumps({**cpu_split.configure_cpu_devices(), "count": jax.device_count(),
                  "nproc": os.environ.get("NPROC")}))
"""


def test_bad_value_is_a_clear_error(monkeypatch):
    for bad in ("two", "0", "-1", "1.5"):
        monkeypatch.setenv(cpu_split.ENV, bad)
        with pytest.raises(ValueError, match=rf"DEW_CPU_DEVICES='{bad}'.*'auto'.*'off'"):
            cpu_split.requested()
    for value, want in (("", "auto"), (" AUTO ", "auto"), ("Off", "off"), ("3", 3)):
        monkeypatch.setenv(cpu_split.ENV, value)
        assert cpu_split.requested() == want


def test_bad_value_stops_the_import():
    program = "import dew.train"
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**base, cpu_split.ENV: "many"},
        timeout=120,
    )
    assert done.returncode != 0
    assert "DEW_CPU_DEVICES='many' is not understood" in done.stderr


@pytest.mark.slow
def test_device_count_at_import():
    auto = run(IMPORT)
    if CORES >= 2:
        assert (auto["devices"], auto["count"]) == (2, 2)
        # the intra-op pool: the cores, and at least one thread more than devices
        assert auto["nproc"] == str(max(CORES, 3))
    else:  # one core: nothing to split over
        assert (auto["devices"], auto["count"]) == (None, 1) and "core" in auto["why"]
    off = run(IMPORT, DEW_CPU_DEVICES="off")
    assert (off["devices"], off["count"], off["why"]) == (None, 1, "DEW_CPU_DEVICES=off")
    three = run(IMPORT, DEW_CPU_DEVICES="3")
    assert (three["devices"], three["count"], three["nproc"]) == (3, 3, str(max(CORES, 4)))
    mine = run(IMPORT, NPROC="7")  # the user's own pool size stands
    assert mine["nproc"] == "7"
    # the user's own count stands
    flags = run(IMPORT, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert (flags["devices"], flags["count"]) == (None, 4) and "XLA_FLAGS" in flags["why"]
    # JAX already running: too late to ask, and said so
    late = run(IMPORT, "early", DEW_CPU_DEVICES="3")
    assert (late["devices"], late["count"]) == (None, 1) and "already running" in late["why"]


# A tiny LM fitted under DEW_CPU_DEVICES=auto: the default mesh's choice, its start
# line, and the parameters and losses of each run.
FIT = """
import io, contextlib, json, sys
import numpy as np
import jax, optax
from dew import Dataset, MeshSpec, Trainer, models
from dew.objectives.lm import LMObjective
from dew.train import cpu_split

threshold, batch = float(sys.argv[-2]), int(sys.argv[-1])
cpu_split.SPLIT_FROM_FLOPS = threshold
model = models.build("causal_transformer", vocab_size=32, emb_features=16, num_layers=2,
                     num_heads=2, mlp_features=32, max_seq_len=8)
rows = np.random.default_rng(0).integers(0, 32, (3, batch, 9)).astype(np.int32)
weights = np.random.default_rng(1).integers(0, 2, (3, batch, 9)).astype(np.int32)
weights[:, :, 1] = 1  # every row counts some target; the weights differ by row
data = Dataset(train=lambda p: ({"text": r, "mask": w} for r, w in zip(rows, weights)),
               val=None, records=3 * batch, batch=batch)
trainer = Trainer(LMObjective(model, seq_len=8, loss_mask_key="mask"),
                  optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2)),
                  key=jax.random.key(0), progress=False)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    state = trainer.fit(data, steps=3, log_every=1)
lines = out.getvalue().splitlines()
print(json.dumps({
    "mesh": {k: int(v) for k, v in trainer.device_mesh.shape.items()},
    "params_devices": len(jax.tree.leaves(state.params)[0].sharding.device_set),
    "note": next((l for l in lines if l.startswith("CPU split")), None),
    "why": trainer._cpu_split,
    "throughput": next(l for l in lines if l.startswith("Throughput:")),
    "losses": [float(l.split("loss ")[1].split(",")[0]) for l in lines if l.startswith("step ")],
    "params": [np.asarray(x, np.float64).ravel().tolist() for x in jax.tree.leaves(state.params)],
}))
"""


@pytest.mark.slow
@pytest.mark.skipif(CORES < 2, reason="auto asks for 2 CPU devices only on 2 or more cores")
def test_trainer_splits_large_steps_and_matches_one_device():
    small = run(FIT, "1e12", "4")
    assert small["mesh"]["data"] == 1 and small["params_devices"] == 1
    # a small step stays on one device without a word (the start line shows it)
    assert small["note"] is None
    assert "under 1000 GFLOP; the step runs on one device" in small["why"]
    split = run(FIT, "0", "4")
    assert split["mesh"]["data"] == 2 and split["params_devices"] == 2
    assert "split over 2 CPU devices" in split["note"]
    # 2 devices == 1: the same masked, clipped run (an all-reduce adds in another
    # order: float32 rounding only)
    np.testing.assert_allclose(split["losses"], small["losses"], rtol=1e-5)
    for got, want in zip(split["params"], small["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    odd = run(FIT, "0", "3")
    assert odd["mesh"]["data"] == 1
    assert "the batch of 3 rows does not divide over 2 devices" in odd["note"]


def test_user_device_count_is_left_alone():
    """Under this session's XLA_FLAGS (8 devices) Dew asks for nothing: the default
    mesh spans all 8, and the trainer makes no choice and prints no note."""
    assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")
    assert cpu_split.configure_cpu_devices()["devices"] is None
    assert cpu_split.split_devices() is None
    model = models.build(
        "causal_transformer", vocab_size=32, emb_features=16, num_layers=1, num_heads=2,
        mlp_features=32, max_seq_len=8,
    )  # fmt: skip
    trainer = Trainer(LMObjective(model, seq_len=8), optax.adamw(1e-2), key=jax.random.key(0))
    data = Dataset(train=lambda p: iter(()), val=None, records=8, batch=8)
    assert trainer._choose_cpu_split(data) is None
    assert trainer.device_mesh.shape["data"] == 8


def test_flops_estimate_matches_the_compiled_step():
    """The init-based estimate (3 x forward FLOPs per example x rows) against the FLOPs
    of the compiled training step's own program (what the log's MFU divides)."""
    model = models.build(
        "causal_transformer", vocab_size=64, emb_features=32, num_layers=2, num_heads=4,
        mlp_features=64, max_seq_len=16,
    )  # fmt: skip
    batch = 8
    trainer = Trainer(
        LMObjective(model, seq_len=16), optax.adamw(1e-2), key=jax.random.key(0),
        progress=False, mesh=MeshSpec(devices=jax.devices()[:1]),
    )  # fmt: skip
    rows = np.random.default_rng(0).integers(0, 64, (1, batch, 17)).astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": r} for r in rows), val=None, records=batch, batch=batch
    )
    trainer.state_shardings(None)
    closed, _ = next(iter(trainer._init_jaxprs.values()))
    estimate = cpu_split.step_flops_estimate(closed, batch)
    trainer.fit(data, steps=1, log_every=0)
    compiled = next(iter(trainer._step_flops.values()))
    # the estimate leaves out the loss and the optimizer (no matrix products) and
    # counts the backward as twice the forward: within 10% at this size
    assert compiled > 0 and abs(estimate / compiled - 1) < 0.1, (estimate, compiled)


# A hand-written data-parallel loop over the two devices, dispatched ahead without
# waiting (as a user's loop is): with as many intra-op threads as devices on 2 cores
# it stopped in XLA's all-reduce rendezvous (40 s, then the process is killed) in 6
# runs of 6; Dew's pool of devices + 1 threads runs it through.
SPLIT_LOOP = """
import json, sys
import numpy as np
import jax, jax.numpy as jnp, optax, flax.linen as nn
import dew.train
from dew import models
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
model = models.build("causal_transformer", vocab_size=264, emb_features=64, num_layers=2,
                     num_heads=4, mlp_features=256, max_seq_len=64)
params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32))["params"])
optimizer = optax.adamw(3e-3)
state = jax.device_put((params, optimizer.init(params)), NamedSharding(mesh, P()))
rows = np.random.default_rng(0).integers(0, 256, (4, 8, 65)).astype(np.int32)
batches = [jax.device_put(r, NamedSharding(mesh, P("data"))) for r in rows]

def loss_fn(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

@jax.jit
def step(state, tokens):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

for i in range(300):
    state, loss = step(state, batches[i % 4])
print(json.dumps({"loss": float(loss), "devices": len(jax.devices())}))
"""


@pytest.mark.slow
@pytest.mark.skipif(CORES < 2, reason="auto asks for 2 CPU devices only on 2 or more cores")
def test_a_split_loop_dispatched_ahead_runs_through():
    done = run(SPLIT_LOOP)
    assert done["devices"] == 2 and np.isfinite(done["loss"])
