"""Preemption: SIGTERM makes a run finish the step in flight, write a checkpoint,
say where and exit cleanly; the next run (a new process) resumes from it and ends
bit-identical to an uninterrupted run."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

CHILD = pathlib.Path(__file__).resolve().parent / "train_child.py"
STEPS = 10


def child(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(CHILD), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_next_run_resumes(tmp_path):
    directory = tmp_path / "run"
    # SIGTERM arrives while batch 4 is read: step 5 is in flight and finishes.
    stopped = child(
        "--dir",
        directory,
        "--steps",
        STEPS,
        "--data",
        "grain",
        "--signal-at",
        4,
        "--signal",
        "SIGTERM",
        "--checkpoint-every",
        0,
        "--out",
        tmp_path / "stopped.npz",
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert f"Stopped by SIGTERM at step 5; checkpoint written to {directory}/5" in stopped.stdout
    assert "step 6:" not in stopped.stdout
    assert stopped.stdout.rstrip().endswith("child: done")  # fit returned the state
    assert int(np.load(tmp_path / "stopped.npz")["step"]) == 5
    assert sorted(os.listdir(directory / "5")) == [
        "_CHECKPOINT_METADATA",
        "checksums",
        "commit_success.txt",
        "data_iter",
        "meta",
        "state",
    ]

    resumed = child(
        "--dir",
        directory,
        "--steps",
        STEPS,
        "--data",
        "grain",
        "--checkpoint-every",
        0,
        "--out",
        tmp_path / "resumed.npz",
        "--reference-out",
        tmp_path / "reference.npz",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from step 5 ({directory}/5). Training from step 5 to 10 on" in resumed.stdout
    got, want = np.load(tmp_path / "resumed.npz"), np.load(tmp_path / "reference.npz")
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert (int(got["step"]), int(got["microstep"]), int(got["updates"])) == (10, 10, 10)
