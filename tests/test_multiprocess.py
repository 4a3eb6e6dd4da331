"""Two processes with 4 CPU devices each (``jax.distributed`` on 127.0.0.1, CPU
collectives through gloo), each reading its own ``Partition`` of every global
batch, train exactly as one process with 8 devices; only process 0 prints and
writes metrics, and both write one committed checkpoint into a shared directory.

This file is also the child: ``python tests/test_multiprocess.py PORT ID OUT``
runs process ``ID`` of 2 and (process 0) writes its losses and the gathered
parameters to ``OUT``.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

STEPS, BATCH, SEQ, VOCAB = 4, 8, 16, 64
CONFIG = dict(
    vocab_size=VOCAB,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=64,
    max_seq_len=SEQ,
)
MESH = dict(data=2, fsdp=2, tensor=2)


def train(run_dir: pathlib.Path, checkpoint_dir: pathlib.Path | None = None):
    """The run both sides make: the same code for one process or several."""
    import jax
    import optax

    from dew.data import Dataset
    from dew.nn import CausalTransformer
    from dew.objectives.language.lm import LMObjective
    from dew.train import Checkpoints, MeshSpec, Trainer

    rows = np.random.default_rng(0).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    read = []  # (process, rows this process read)

    def train_batches(partition):
        for batch in itertools.cycle(rows):
            read.append((partition.index, partition.count))
            yield {"text": batch[partition.slice(BATCH)]}

    data = Dataset(train=train_batches, val=None, records=STEPS * BATCH, batch=BATCH)
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**CONFIG), seq_len=SEQ),
        optax.sgd(0.5),
        key=jax.random.key(0),
        mesh=MeshSpec(**MESH),
        run_dir=str(run_dir),
        checkpoints=checkpoint_dir and Checkpoints(checkpoint_dir),
    )
    state = trainer.fit(data, steps=STEPS, log_every=1)
    assert set(read) == {(jax.process_index(), jax.process_count())}
    return state


def losses_of(run_dir: pathlib.Path) -> list[float]:
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["loss"] for r in records if r["kind"] == "train"]


def child(port: int, process_id: int, out: pathlib.Path) -> None:
    # the parent's other XLA flags (CI compiles faster), 4 devices of this process's own
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    import jax
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 4, 8)
    # one run directory and one checkpoint directory, shared by both processes
    state = train(out.parent / "run", out.parent / "checkpoints")
    params = multihost_utils.process_allgather(state.params, tiled=True)  # every process joins
    if process_id == 0:
        out.mkdir(parents=True, exist_ok=True)
        flat = {
            jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(params)
        }
        np.savez(out / "params.npz", **flat)
        (out / "losses.json").write_text(json.dumps(losses_of(out.parent / "run")))
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process_with_eight_devices(tmp_path, xla_flags):
    import jax

    port = free_port()
    env = os.environ | {"XLA_FLAGS": xla_flags(None)}  # each child sets its 4
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(port), str(i), str(tmp_path / f"p{i}")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    # only process 0 talks: the start line (with the process count) and the step lines
    assert f"on {dict(MESH, expert=1, sequence=1, stage=1)}" not in outputs[1][0]
    assert "step 1: loss" in outputs[0][0] and "step 1: loss" not in outputs[1][0]
    assert "(2 process(es))" in outputs[0][0]
    assert len(outputs[0][0]) > 0 and "checkpoint" not in outputs[1][0].lower()
    from dew.train import Checkpoints

    assert Checkpoints(tmp_path / "checkpoints").steps() == [STEPS]  # written by both, committed

    assert jax.device_count() == 8 and jax.process_count() == 1
    state = train(tmp_path / "one")
    want_losses = losses_of(tmp_path / "one")
    got_losses = json.loads((tmp_path / "p0" / "losses.json").read_text())
    # the same program on the same 8-device mesh; gloo's all-reduce may add in
    # another order than XLA's in-process one: float32 rounding, rtol 1e-5
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    got = np.load(tmp_path / "p0" / "params.npz")
    want = {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
    }
    assert sorted(got.files) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


if __name__ == "__main__":
    child(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]))
