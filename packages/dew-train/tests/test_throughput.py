"""Throughput in the log: the step's FLOPs against closed forms and XLA, MFU
from them, donation of the state on the compiled step's memory analysis."""

from __future__ import annotations

import itertools
import json
import os
import platform
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives.language.lm import LMObjective
from dew.train import Trainer
from dew.train import throughput as tp

BATCH, SEQ = 8, 8
PEAK_PER_CORE = 1e9  # FLOP/s, instead of the probe: MFU is then checkable by hand


def closed_form_flops(config: dict, batch: int, seq: int, *, causal_halved=False) -> float:
    """Matmul FLOPs of one training step of a dense CausalTransformer, by hand.

    Forward: ``2 * params * tokens`` for every projection (q, k, v, out, the
    SwiGLU gate/up/down, the LM head; the embedding is a lookup), plus the two
    attention products ``2 * 2 * batch * seq^2 * heads * head_dim`` per layer.
    The backward pass does each product twice more (the gradient of each
    operand): 3x the forward, i.e. ``6 * params * tokens + 12 * ...``.
    ``causal_halved``: the model FLOPs of MFU as MaxText counts them (attention
    under a causal mask halved); else the products the step computes.
    """
    e, f, v = config["emb_features"], config["mlp_features"], config["vocab_size"]
    heads, kv = config["num_heads"], config["num_kv_heads"]
    head_dim = e // heads
    per_layer = e * heads * head_dim * 2 + e * kv * head_dim * 2 + 3 * e * f
    params = config["num_layers"] * per_layer + e * v
    tokens = batch * seq
    attention = config["num_layers"] * 4 * batch * seq * seq * heads * head_dim
    if causal_halved:
        attention //= 2
    return 6 * params * tokens + 3 * attention


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One short unrolled fit (every device on data; parameters replicated): its log,
    metrics and compiled step."""
    run_dir = tmp_path_factory.mktemp("run")
    cache = tmp_path_factory.mktemp("cache")
    config = {**TINY_LM, "use_scan": False}
    model = CausalTransformer(**config)
    rows = np.random.default_rng(0).integers(0, 32, (BATCH, SEQ + 1)).astype(np.int32)
    data = Dataset(
        train=lambda p: itertools.repeat({"text": rows}), val=None, records=BATCH, batch=BATCH
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=SEQ),
        optax.adamw(1e-3),
        key=jax.random.key(0),
        run_dir=str(run_dir),
        progress=False,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEW_CACHE_DIR", str(cache))
        mp.setattr(tp, "cpu_peak", lambda: (PEAK_PER_CORE, "test peak"))
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            trainer.fit(data, steps=4, log_every=2)
    records = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    (compiled,) = [c.program for c in trainer.programs.cache.update.values()]
    return config, trainer, out.getvalue().splitlines(), records, compiled


def test_step_flops_equal_the_closed_form_and_xla(fitted):
    config, _, lines, records, compiled = fitted
    train = [r for r in records if r["kind"] == "train"]
    flops = train[0]["step_flops"]  # model FLOPs: causal attention halved
    assert flops == pytest.approx(closed_form_flops(config, BATCH, SEQ, causal_halved=True))
    want = closed_form_flops(config, BATCH, SEQ)
    # XLA's count of the same compiled (unrolled) step is per device (the batch
    # split over the data-parallel devices) and adds the elementwise operations
    # (norms, softmax, adamw on replicated parameters): at this tiny width about
    # as many again as the matmuls (1.9x measured), so between 1x and 3x
    devices = jax.device_count()
    cost = compiled.cost_analysis()
    xla = float((cost[0] if isinstance(cost, list) else cost)["flops"])
    assert want / devices < xla < 3 * want / devices
    (line,) = [x for x in lines if x.startswith("Throughput: ")]
    assert f"{flops / 1e9:,.3f} GFLOP per step" in line and "test peak" in line


def test_scanned_stack_counts_every_layer():
    """XLA's cost analysis counts a while loop's body once; program_flops counts
    a scan's body ``length`` times, so scanned == unrolled."""
    tokens = jnp.zeros((2, SEQ), jnp.int32)
    counts = []
    for use_scan in (True, False):
        model = CausalTransformer(**{**TINY_LM, "use_scan": use_scan})
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)

        def loss(p, model=model):
            return model.apply(p, tokens).sum()

        counts.append(tp.program_flops(jax.make_jaxpr(jax.grad(loss))(params)))
    assert counts[0] == counts[1] == closed_form_flops(TINY_LM, 2, SEQ)


def test_a_shard_map_body_counts_once_per_device():
    """A shard_map body sees one device's shapes: counted times its manual devices,
    so expert-parallel MoE layers are not undercounted. 8 devices, each [2, 3] @ [3, 2]:
    8 x 2 * 2 * 2 * 3 (the 'b' axis computes its rows twice: executed FLOPs)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    spec = jax.sharding.PartitionSpec("a", None)
    body = jax.shard_map(lambda x: x @ x.T, mesh=mesh, in_specs=spec, out_specs=spec)
    assert tp.program_flops(jax.make_jaxpr(body)(jnp.ones((8, 3)))) == 8 * 2 * 2 * 2 * 3


def test_log_lines_carry_tokens_per_second_and_mfu(fitted):
    _, _, lines, records, _ = fitted
    train = [r for r in records if r["kind"] == "train"]
    steps = [x for x in lines if x.startswith("step ")]
    assert len(steps) == len(train) == 2
    peak = PEAK_PER_CORE * tp.available_cores()
    for line, record in zip(steps, train):
        m = re.fullmatch(r"step \d+: loss [\d.]+, ([\d,]+) tokens/s, MFU ([\d.]+)%", line)
        assert m, line
        # tokens/s: the batch's tokens over the measured step time
        assert record["tokens_per_second"] == pytest.approx(
            BATCH * SEQ / record["step_seconds"], rel=1e-6
        )
        assert float(m.group(1).replace(",", "")) == pytest.approx(
            record["tokens_per_second"], abs=0.5
        )
        mfu = record["step_flops"] / record["step_seconds"] / peak
        assert record["mfu"] == pytest.approx(mfu, rel=1e-9)
        assert float(m.group(2)) == pytest.approx(100 * mfu, abs=0.005)
    assert lines[0].startswith("Training from step 0 to 4 on ")


def test_state_is_donated_no_second_copy(fitted):
    """The compiled step writes the new params and optimizer state into the
    buffers of the old ones: every output byte but the metrics is aliased."""
    _, trainer, _, _, compiled = fitted
    memory = compiled.memory_analysis()
    abstract, _ = trainer.state_shardings(None)
    nbytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves((abstract.params, abstract.opt_state))
    )
    assert memory.alias_size_in_bytes >= nbytes
    # what is not aliased: the metrics (a few float32 scalars) and the counters
    assert memory.output_size_in_bytes - memory.alias_size_in_bytes < 1024


def test_cpu_probe_runs_inside_the_run_mesh_and_keeps_each_jax_versions_entry(
    tmp_path, monkeypatch
):
    """The probe runs on its first use, which is inside the trainer's 8-device mesh
    context; its cache holds one entry per machine token (two jax versions on one
    machine do not overwrite each other), and a cached entry is read back as is."""
    monkeypatch.setenv("DEW_CACHE_DIR", str(tmp_path))
    other = "x86_64|2|0.0.other"
    (tmp_path / tp.CACHE_NAME).write_text(json.dumps({"machine": other, "per_core_flops": 7.0}))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("data",))
    with jax.set_mesh(mesh):
        per_core, source = tp.cpu_peak()
    assert per_core > 1e6 and source == "CPU peak measured by matmul probe"
    cached = json.loads((tmp_path / tp.CACHE_NAME).read_text())
    assert cached[other] == 7.0 and len(cached) == 2
    monkeypatch.setattr(tp, "probe_cpu", lambda: pytest.fail("probed again"))
    again, source = tp.cpu_peak()
    assert again == per_core and source.endswith("(cached)")


def test_an_entry_of_another_probe_size_is_measured_again(tmp_path, monkeypatch):
    """The cache key holds the probe size: an entry the 512 probe wrote for this very
    machine and jax (it read a quarter of the cores' rate under load) is not reused."""
    monkeypatch.setenv("DEW_CACHE_DIR", str(tmp_path))
    machine = platform.processor() or platform.machine()
    old = f"{machine}|{os.cpu_count()}|{jax.__version__}"  # the key before the probe size
    (tmp_path / tp.CACHE_NAME).write_text(json.dumps({old: 2.4e10, f"{old}|512": 2.4e10}))
    monkeypatch.setattr(tp, "probe_cpu", lambda: 1.0e11)
    per_core, source = tp.cpu_peak()
    assert (per_core, source) == (1.0e11, "CPU peak measured by matmul probe")
    cached = json.loads((tmp_path / tp.CACHE_NAME).read_text())
    assert cached[f"{old}|{tp.PROBE_SIZE}"] == 1.0e11 and cached[old] == 2.4e10
