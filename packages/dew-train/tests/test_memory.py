"""Out of memory predicted, not suffered: a fit whose compiled step needs more
than the device may hold is refused before its first step, naming the bytes
needed and available and what to change; a checkpoint already written stays
usable. The limit is set small on the CPU (which has none of its own)."""

from __future__ import annotations

import itertools
import os
import re

import jax
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives.language.lm import LMObjective
from dew.train import Checkpoints, MeshSpec, StepDoesNotFit, Trainer, memory, plan

SEQ, BATCH = 8, 8
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def run(**kwargs):
    rows = np.random.default_rng(0).integers(0, 32, (BATCH, SEQ + 1)).astype(np.int32)
    data = Dataset(
        train=lambda p: itertools.repeat({"text": rows}), val=None, records=BATCH, batch=BATCH
    )
    objective = LMObjective(model=CausalTransformer(**TINY_LM), seq_len=SEQ)
    trainer = Trainer(
        objective, optax.adam(1e-3), key=jax.random.key(0), mesh=ONE, progress=False, **kwargs
    )
    return trainer, data


def test_a_step_that_does_not_fit_is_refused_before_it_runs(tmp_path):
    directory = str(tmp_path / "ckpt")
    trainer, data = run(checkpoints=Checkpoints(directory))
    trainer.fit(data, steps=2, log_every=0)
    (update,) = trainer.programs.cache.update.values()
    needed = update.peak_bytes
    assert needed > 0

    # the same run on a device 1 KiB too small: refused when the step is compiled
    trainer, data = run(checkpoints=Checkpoints(directory), device_memory_bytes=needed - 1024)
    seen = []
    trainer.add_hook(lambda info: seen.append(info.step))
    with pytest.raises(StepDoesNotFit) as refused:
        trainer.fit(data, steps=4, log_every=0)
    message = str(refused.value)
    assert f"needs {needed:,} bytes" in message
    assert f"has {needed - 1024:,} bytes" in message
    for advice in ("remat", "accumulate", "fsdp", "dew plan"):
        assert advice in message
    assert seen == []  # no step ran, no hook saw one
    # nothing written lost: the step-2 checkpoint is still the newest and resumes
    trainer, data = run(checkpoints=Checkpoints(directory), device_memory_bytes=needed)
    state = trainer.fit(data, steps=3, log_every=0)
    assert int(state.step) == 3


def test_the_environment_sets_the_limit_and_plan_says_whether_it_fits(monkeypatch):
    shapes = {"text": ((BATCH, SEQ + 1), np.int32)}
    objective = LMObjective(model=CausalTransformer(**TINY_LM), seq_len=SEQ)
    report = plan(objective, optax.adam(1e-3), mesh=ONE, batch=shapes)
    assert report.device_memory_bytes is None and report.fits is None  # a CPU: no limit
    monkeypatch.setenv(memory.ENV, f"{report.peak_bytes - 1}")
    small = plan(objective, optax.adam(1e-3), mesh=ONE, batch=shapes)
    assert small.peak_bytes == report.peak_bytes and small.fits is False
    assert "does NOT fit" in str(small)
    roomy = plan(objective, optax.adam(1e-3), mesh=ONE, batch=shapes, device_memory_bytes="1GiB")
    assert roomy.device_memory_bytes == 2**30 and roomy.fits is True


def test_sizes_parse_and_errors_say_what_to_give():
    assert memory.parse_bytes("16GiB") == 16 * 2**30
    assert memory.parse_bytes("512M") == 512 * 2**20
    assert memory.parse_bytes(1000) == 1000
    with pytest.raises(ValueError, match=re.escape("16GiB")):
        memory.parse_bytes("lots")
    assert memory.device_memory_bytes(jax.devices()[:1]) is None or os.environ.get(memory.ENV)
    memory.check_fits(10, None)  # no limit known: nothing checked
    with pytest.raises(StepDoesNotFit, match="needs 11 bytes"):
        memory.check_fits(11, 10)
