"""Two processes (``jax.distributed`` on 127.0.0.1, 4 CPU devices each, the
parameters and Adam moments sharded over all 8 along ``fsdp``) save
checkpoints at steps 2 and 4; each process records the checksums of the
shards it wrote and its data position. Then what only the second process
wrote is damaged in checkpoint 4:

- ``flipped-bit``: one bit in the middle of a chunk of an array in that
  process's data file (stored as it was: zstd and OCDBT read it back as another
  number, without an error; only the checksum can tell);
- ``data-position``: its data-position file cut short (an undecodable file, read by
  that process alone, after Orbax's restore).

The restart sets checkpoint 4 aside on both processes, process 0's line naming
the array (or the file) and the process, resumes both from checkpoint 2, and
ends with the state of the uninterrupted run, bit for bit.

This file is also the child: ``python tests/test_multiprocess_restore.py PORT ID
DIR OUT`` runs process ``ID`` of 2 on the checkpoint directory ``DIR``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_multiprocess import CONFIG, SEQ, VOCAB, free_port  # noqa: E402

STEPS, BATCH, EVERY = 4, 8, 2
MESH = dict(fsdp=8)  # every array split over both processes' devices


def child(port: int, process_id: int, directory: pathlib.Path, out: pathlib.Path) -> None:
    # the parent's other XLA flags (CI compiles faster), 4 devices of this process's own
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    )
    import jax
    import optax
    from jax.experimental import multihost_utils

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    from dew.data import Dataset
    from dew.nn import CausalTransformer
    from dew.objectives.language.lm import LMObjective
    from dew.train import Checkpoints, MeshSpec, Trainer

    rows = np.random.default_rng(0).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)

    class Batches:
        """This process's rows of each step's batch; its position saves and restores."""

        def __init__(self, partition):
            self.partition, self.step = partition, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.step += 1
            return {"text": rows[self.step - 1][self.partition.slice(BATCH)]}

        def get_state(self):
            return {"step": self.step}

        def set_state(self, state):
            self.step = state["step"]

    train_batches = Batches

    data = Dataset(train=train_batches, val=None, records=STEPS * BATCH, batch=BATCH)
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**CONFIG), seq_len=SEQ),
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=MeshSpec(**MESH),
        checkpoints=Checkpoints(directory, keep=None),
    )
    steps = []
    trainer.add_hook(lambda info: steps.append(info.step))
    state = trainer.fit(data, steps=STEPS, log_every=1, checkpoint_every=EVERY)
    gathered = multihost_utils.process_allgather(
        {"params": state.params, "opt_state": state.opt_state}, tiled=True
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"steps_{process_id}.json").write_text(json.dumps(steps))
    if process_id == 0:
        flat = {
            jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(gathered)
        }
        flat["step"] = np.asarray(jax.device_get(state.step))
        np.savez(out / "state.npz", **flat)
    jax.distributed.shutdown()


# the pieces gloo's connection line is printed in (one stream insertion each), so
# that lines two threads interleave at any piece are recognised
GLOO_PIECES = (
    r"\[Gloo\] Rank|is connected to|peer ranks\. Expected number of connected peer "
    r"ranks is :|\d+|\s+"
)


def run_two(directory: pathlib.Path, out: pathlib.Path, flags: str) -> str:
    """Both processes on ``directory``; process 0's output (the other prints nothing)."""
    port = free_port()
    env = os.environ | {"XLA_FLAGS": flags}  # each child sets its 4 devices
    args = [str(port), "", str(directory), str(out)]
    procs = []
    for i in range(2):
        args[1] = str(i)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=420))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-5000:]}"
    # only process 0 talks, gloo's own connection lines aside: gloo's threads print
    # "[Gloo] Rank 1 is connected to 1 peer ranks. Expected ... is : 1" each, and two
    # can interleave at any of its pieces
    left = re.sub(GLOO_PIECES, "", outputs[1][0])
    assert left == "", outputs[1][0]
    return outputs[0][0]


def chunks_written_by(state_dir: pathlib.Path, process: int) -> list[tuple[str, bytes]]:
    """``(zarr chunk key, its stored bytes)`` of the chunks in the files process
    ``process`` wrote that lie outside OCDBT's checksummed b-tree nodes (over 1 KiB)
    and that zstd kept as they were (no smaller than the chunk's bytes: random
    floats), so a flipped bit in them decodes to another number without an error."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state_dir}/"}).result()
    owned = (state_dir / f"ocdbt.process_{process}").rglob("*")
    files = [p.read_bytes() for p in owned if p.is_file()]
    found = []
    for key in (k.decode() for k in store.list().result()):
        array, _, chunk = key.rpartition("/")
        if chunk.startswith("."):
            continue  # .zarray, .zattrs
        meta = json.loads(store.read(f"{array}/.zarray").result().value)
        size = int(np.prod(meta["chunks"])) * np.dtype(meta["dtype"]).itemsize
        value = store.read(key).result().value
        if len(value) > 1024 and len(value) >= size and any(value in f for f in files):
            found.append((key, value))
    return found


def flip_bit(path: pathlib.Path, offset: int, bit: int = 4) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped-bit", "data-position"])
def test_what_the_second_process_wrote_damaged_is_set_aside_on_both(tmp_path, damage, xla_flags):
    directory = tmp_path / "checkpoints"
    straight = run_two(directory, tmp_path / "straight", xla_flags(None))
    assert "Resuming" not in straight
    from dew.train import Checkpoints

    assert Checkpoints(directory).steps() == [2, 4]
    for step in (2, 4):  # each process recorded the sums of its own shards
        records = sorted((directory / str(step) / "checksums").glob("process_*.json"))
        assert [p.name for p in records] == ["process_0-of-2.json", "process_1-of-2.json"]
        shards = [json.loads(p.read_text())["arrays"] for p in records]
        assert all(shards) and shards[0] != shards[1]

    if damage == "flipped-bit":
        state_dir = directory / "4" / "state"
        ours = chunks_written_by(state_dir, 1)
        assert ours and not set(ours) & set(chunks_written_by(state_dir, 0))
        key, chunk = max(ours, key=lambda kv: (kv[0].startswith("params."), len(kv[1]), kv[0]))
        damaged = []
        for path in state_dir.rglob("*"):  # the process's file and any copy merged from it
            if path.is_file() and chunk in path.read_bytes():
                flip_bit(path, path.read_bytes().find(chunk) + len(chunk) // 2)
                damaged.append(path)
        assert any(f"ocdbt.process_1{os.sep}" in str(p) for p in damaged)
        array = key.split("/")[0].replace(".", "/")  # zarr's "params.layers.mlp.up.kernel/..."
        why = (
            rf"it is damaged: array '{re.escape(array)}' \(shard \[[^\]]+\]\) held by process 1 "
            r"does not match the checksum saved with it \(xxh3-128-v1 [0-9a-f]{32} saved, "
            r"[0-9a-f]{32} read back\)"
        )
    else:
        position = directory / "4" / "data_iter" / "process_1-of-2.json"
        assert json.loads(position.read_text()) == {"state": {"step": 4}}
        position.write_text(position.read_text()[:5])
        why = r"it cannot be read on process 1 \(JSONDecodeError: [^\n]+\)"

    resumed = run_two(directory, tmp_path / "resumed", xla_flags(None))
    skipped = re.search(
        rf"Skipping checkpoint {re.escape(str(directory))}/4: {why}; "
        rf"kept as {re.escape(str(directory))}/4.unusable, nothing deleted",
        resumed,
    )
    assert skipped, resumed
    assert f"Resuming from step 2 ({directory}/2)" in resumed
    for process in (0, 1):  # both resumed from step 2: their hooks saw steps 3 and 4
        seen = json.loads((tmp_path / "resumed" / f"steps_{process}.json").read_text())
        assert seen == [3, 4], (process, seen)
    assert Checkpoints(directory).steps() == [2, 4]
    assert (directory / "4.unusable").is_dir()

    want = np.load(tmp_path / "straight" / "state.npz")
    got = np.load(tmp_path / "resumed" / "state.npz")
    assert sorted(got.files) == sorted(want.files) and int(got["step"]) == STEPS
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


if __name__ == "__main__":
    child(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]), pathlib.Path(sys.argv[4]))
