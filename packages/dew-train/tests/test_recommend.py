"""recommend: the fastest remat policy x accumulate whose step fits a (fake, small)
device memory; the recommended setting fits by its own memory analysis and the
faster ones tried do not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import dew.nn.stack
from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, plan, recommend
from dew.train.recommend import REMAT_POLICIES, accumulate_choices, policy_order

ONE = MeshSpec(data=1, devices=jax.devices()[:1])
SEQ, ROWS = 32, 8
SHAPES = {"text": ((ROWS, SEQ + 1), jnp.int32)}
# vocab >= 264: LMObjective resolves the default byte tokenizer into its field, which a
# rebuilt objective (dataclasses.replace) then checks against the vocabulary
MODEL = CausalTransformer(
    vocab_size=264, emb_features=32, num_layers=2, num_heads=2, mlp_features=128, max_seq_len=SEQ
)


def peak(use_remat: bool, accumulate: int) -> int:
    objective = LMObjective(model=MODEL.clone(use_remat=use_remat), seq_len=SEQ)
    return plan(
        objective, optax.adam(1e-3), mesh=ONE, batch=SHAPES, accumulate=accumulate
    ).peak_bytes


@pytest.mark.slow
def test_the_fastest_setting_that_fits_is_recommended():
    objective = LMObjective(model=MODEL, seq_len=SEQ)
    none_1, none_2, full_2 = peak(False, 1), peak(False, 2), peak(True, 2)
    assert full_2 < none_2 < none_1  # what the choices below rest on

    # between none x 1 and none x 2: no remat, two microbatches
    limit = (none_1 + none_2) // 2
    found = recommend(
        objective, optax.adam(1e-3), mesh=ONE, batch=SHAPES, device_memory_bytes=limit,
        accumulates=(1, 2),
    )  # fmt: skip
    assert (found.remat_policy, found.accumulate) == ("none", 2)
    assert found.plan.peak_bytes == none_2 <= limit and found.plan.fits
    assert ("none", 1, none_1) in found.tried and none_1 > limit  # the faster one does not fit
    assert "recommended: remat_policy='none', accumulate=2" in str(found)

    # between full x 2 and none x 2: no remat does not fit at all, full remat does
    limit = (full_2 + none_2) // 2
    found = recommend(
        objective, optax.adam(1e-3), mesh=ONE, batch=SHAPES, device_memory_bytes=limit,
        accumulates=(1, 2),
    )  # fmt: skip
    assert found.remat_policy != "none" and found.plan.peak_bytes <= limit
    assert ("none", 2, none_2) in found.tried and none_2 > limit
    # every faster setting tried (less recomputation, or as much in fewer microbatches)
    # does not fit; the policies come in REMAT_POLICIES order (a backbone with only
    # use_remat skips the named ones between 'none' and 'full')
    rank = REMAT_POLICIES.index
    best = (rank(found.remat_policy), found.accumulate)
    faster = [(p, a, b) for p, a, b in found.tried if (rank(p), a) < best]
    assert faster and all(b is None or b > limit for _, _, b in faster)
    tried = [p for p, _, _ in found.tried]
    assert tried == sorted(tried, key=rank)
    assert found.model_settings in ({"remat_policy": found.remat_policy}, {"use_remat": True})

    nothing = recommend(
        objective, optax.adam(1e-3), mesh=ONE, batch=SHAPES, device_memory_bytes=1024,
        accumulates=(2,),
    )  # fmt: skip
    assert not nothing.fits and "nothing fits" in str(nothing)


def test_accumulate_choices_split_the_rows_over_the_data_devices():
    assert accumulate_choices(8, 1) == (1, 2, 4, 8)
    assert accumulate_choices(24, 2) == (1, 2, 4)
    assert accumulate_choices(8, 1, limit=2) == (1, 2)


def test_a_cpu_needs_the_limit_given(monkeypatch):
    monkeypatch.delenv("DEW_DEVICE_MEMORY", raising=False)
    with pytest.raises(ValueError, match="device_memory_bytes="):
        recommend(LMObjective(model=MODEL, seq_len=SEQ), optax.adam(1e-3), mesh=ONE, batch=SHAPES)


def test_a_scanned_stack_on_a_tpu_tries_its_default_first(monkeypatch):
    """On a TPU a scanned stack's default ('minimal') ran faster than keeping
    everything, so recommend tries it first there; elsewhere the order is
    REMAT_POLICIES'. The backend's name is patched: the compiles run on the CPU."""
    objective = LMObjective(model=MODEL, seq_len=SEQ)
    assert policy_order(objective) == REMAT_POLICIES
    looped = LMObjective(model=MODEL.clone(use_scan=False), seq_len=SEQ)
    monkeypatch.setattr(dew.nn.stack, "_backend", lambda: "tpu")
    assert policy_order(objective) == ("minimal", "none", "save_dot_except_mlp",
                                       "save_qkv_proj", "full")  # fmt: skip
    assert policy_order(looped) == REMAT_POLICIES  # a loop of blocks keeps 'none'
    # a model that names a policy is judged by its default all the same
    named = LMObjective(model=MODEL.clone(remat_policy="full"), seq_len=SEQ)
    assert policy_order(named)[0] == "minimal"
    found = recommend(
        objective, optax.adam(1e-3), mesh=ONE, batch=SHAPES, device_memory_bytes=1 << 40,
        accumulates=(1,),
    )  # fmt: skip
    assert [p for p, _, _ in found.tried] == ["minimal"]
    assert (found.remat_policy, found.accumulate) == ("minimal", 1) and found.fits
