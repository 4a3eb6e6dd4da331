"""Checkpoints of every layout this Dew reads (``dew.train._layout``).

``golden/layout1`` holds checkpoints written at step 2 by the code before trained
parameters were keyed by role (layout 1, commit b5d5b98, ``golden/layout1_writer.py``)
and that code's own continuation of each run to step 4. This code resumes them bit
for bit: the same parameters, moving average, optimizer state and counters, array
for array; a checkpoint of an unknown layout version stops the run before anything
is compiled, naming the versions this Dew reads.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dew.train import CheckpointLayoutError, load_model
from dew.train._layout import LAYOUT, READS

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
import layout1_writer as writer  # noqa: E402


def old_run(name: str, tmp_path: Path) -> Path:
    """A run directory holding the golden step-2 checkpoint of run ``name``."""
    directory = tmp_path / name
    shutil.copytree(GOLDEN / "layout1" / name, directory)
    return directory


@pytest.mark.parametrize("name", ["lm", "two_roles"])
def test_a_checkpoint_of_the_layout_before_roles_resumes_bit_for_bit(name, tmp_path, capsys):
    directory = old_run(name, tmp_path)
    assert "layout" not in json.loads((directory / "2" / "meta" / "metadata").read_text())
    _, data = writer.RUNS[name]
    final = writer.trainer(name, directory).fit(data(), steps=writer.STEPS, log_every=0)
    # restored, not trained again from step 0 (which ends with the same numbers)
    assert f"Resuming from step 2 ({directory}/2)" in capsys.readouterr().out
    got = writer.flat(final)
    want = dict(np.load(GOLDEN / "layout1" / f"{name}_continued.npz"))
    if name == "lm":  # one trained role: keyed now in the optimizer state only
        assert sorted(final.params_by_role) == ["policy"]
        got = {k.replace("['policy']", ""): v for k, v in got.items()}
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        if np.issubdtype(value.dtype, np.floating):
            # The two steps after the restore are compiled by today's code, whose
            # programs may round a last bit differently from the writer's (a change of
            # fusion: the non-finite guard as a select per leaf, then its selects
            # ordered so that XLA writes the optimizer state in place), and by XLA:CPU
            # for the machine it runs on (its vector width decides how sums round: 4.5
            # ulp seen on a moment on an AMD EPYC without AVX-512): within 32 ulp of the
            # leaf's largest value (a moment near 0 has tiny ulps of its own), about 4e-6
            # of it, where one step more or less moves a moment by about a tenth of it
            # (b1 = 0.9). The restore itself is exact (the next test), and so is a
            # resume of today's layout (test_checkpoints, test_optax_resume).
            ulp = np.spacing(np.max(np.abs(value)).astype(value.dtype))
            np.testing.assert_allclose(got[key], value, rtol=0, atol=32 * ulp, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], value, err_msg=key, strict=True)
    assert int(final.step) == writer.STEPS and int(final.updates) == writer.STEPS
    # the resumed run writes the current layout; load_model reads both (a registered
    # model's checkpoints: the LM's)
    meta = json.loads((directory / "4" / "meta" / "metadata").read_text())
    assert meta["layout"] == LAYOUT
    if name != "lm":
        return
    new = load_model(directory, step=4, averaged=False)[1]
    old = load_model(directory, step=2, averaged=False)[1]
    assert jax.tree.structure(new) == jax.tree.structure(final.params)
    assert jax.tree.structure(old) == jax.tree.structure(final.params)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(final.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["lm", "two_roles"])
def test_the_restored_state_is_the_old_checkpoint_array_for_array(name, tmp_path):
    import orbax.checkpoint as ocp

    directory = old_run(name, tmp_path)
    _, data = writer.RUNS[name]
    restored = writer.trainer(name, directory).fit(data(), steps=writer.SAVED, log_every=0)
    got = writer.flat(restored)
    if name == "lm":
        got = {k.replace("['policy']", ""): v for k, v in got.items()}
    # an optimizer state's named fields (``.mu``) are dict keys in the checkpoint
    got = {re.sub(r"\.(\w+)", r"['\1']", k): v for k, v in got.items()}
    # the checkpoint's arrays as orbax reads them, without Dew: layout 1's paths
    raw = ocp.PyTreeCheckpointer().restore((directory / str(writer.SAVED) / "state").resolve())
    saved = {
        f"{path[0].key}{jax.tree_util.keystr(path[1:])}": np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(raw)
    }
    floats = [k for k, v in got.items() if np.issubdtype(v.dtype, np.floating)]
    assert len(floats) > 10 and set(floats) <= set(saved)
    for key in got:
        np.testing.assert_array_equal(got[key], saved[key], err_msg=key, strict=True)


def test_a_checkpoint_of_an_unknown_layout_stops_before_compiling(tmp_path):
    directory = old_run("lm", tmp_path)
    meta_file = directory / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "layout": 99}))
    trainer = writer.trainer("lm", directory)
    with pytest.raises(CheckpointLayoutError) as raised:
        trainer.fit(writer.lm_data(), steps=writer.STEPS, log_every=0)
    message = str(raised.value)
    assert "has layout version 99" in message
    assert f"reads layout versions {list(READS)}" in message
    assert not trainer.programs.cache.update and not trainer.programs.cache.init
    assert (directory / "2").is_dir()  # a mistake, not damage: nothing set aside
    with pytest.raises(CheckpointLayoutError, match="has layout version 99"):
        load_model(directory)


def test_an_init_whose_params_are_not_keyed_by_role_is_refused_before_compiling():
    import optax

    from dew.objectives.lm import LMObjective
    from dew.train import Trainer

    class Unkeyed(LMObjective):  # the layout before: one trained role's tree as it is
        def init(self, key, spec=None):
            return {"params": super().init(key, spec)["params"]["policy"]}

    lm = writer.lm_objective()
    trainer = Trainer(Unkeyed(model=lm.model, seq_len=8), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"Unkeyed.init returned params \['embed', .*keyed by "):
        trainer.state_shardings()
    assert not trainer.programs.cache.init
