"""dew.train.run_lock: one process writes a run directory."""

import os
import subprocess
import sys

import pytest

from dew.train.run_lock import RunInUseError, lock_run, release_run

HOLD = (
    "import sys, time; from dew.train.run_lock import lock_run; "
    "lock_run(sys.argv[1]); print('held', flush=True); time.sleep(120)"
)


def holder(directory):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def can_lock(directory) -> bool:
    """Whether another process could take the lock now."""
    probe = subprocess.run(
        [sys.executable, "-c", HOLD.replace("time.sleep(120)", "0"), str(directory)],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


def test_a_second_process_is_refused_naming_the_holder_until_it_dies(tmp_path):
    process = holder(tmp_path)
    try:
        with pytest.raises(RunInUseError) as caught:
            lock_run(tmp_path)
        assert f"{tmp_path} is in use by another process (pid {process.pid} on host " in str(
            caught.value
        )
    finally:
        process.kill()  # SIGKILL: the OS lets the lock go
        process.wait()
    lock_run(tmp_path)
    release_run(tmp_path)


def test_holds_in_one_process_are_counted(tmp_path):
    lock_run(tmp_path)
    lock_run(tmp_path)  # the command, then its fit: the same lock
    release_run(tmp_path)
    assert not can_lock(tmp_path)
    release_run(tmp_path)
    assert can_lock(tmp_path)
    assert open(os.path.join(tmp_path, ".lock")).read().startswith("pid ")
