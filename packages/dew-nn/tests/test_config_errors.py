"""Bad model configurations are refused when the module is built, for every
registered backbone, with a message that names the field, its value, what it
means and the range it must be in: no tracing, no compiling, no raw JAX error."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest

from dew.nn import models
from dew.nn.testing import TINY_DIT, TINY_ENCODER, TINY_LM, TINY_PREDICTOR, TINY_VIT

# A valid tiny configuration of every registered model.
VALID = {
    "causal_transformer": TINY_LM,
    "transformer": TINY_ENCODER,
    "vit": TINY_VIT,
    "vit_classifier": dict(TINY_VIT, num_classes=5),
    "vit_predictor": TINY_PREDICTOR,
    "dit": TINY_DIT,
    "video_dit": dict(TINY_DIT, num_frames=2),
}
# Counts where 0 is a documented setting ("off", "none").
ZERO_ALLOWED = {"num_experts", "moe_shared_features", "num_classes", "context_features"}
# ... except where a backbone needs one (a classifier's classes).
ZERO_REFUSED = {("vit_classifier", "num_classes")}
# Counts read only under another setting (experts_per_token: only with num_experts > 0).
UNCHECKED = {"experts_per_token"}


def count_fields(name: str) -> list[str]:
    """The integer fields of a registered model (int or int | None; not bools)."""
    cls = models.get(name)
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        if field.name in ("parent", "name") or field.name in UNCHECKED:
            continue
        kinds = set(typing.get_args(hints[field.name])) or {hints[field.name]}
        if int in kinds and bool not in kinds and float not in kinds:
            out.append(field.name)
    return out


def zero_allowed(name: str, field: str) -> bool:
    return field in ZERO_ALLOWED and (name, field) not in ZERO_REFUSED


CASES = [
    (name, field, value)
    for name in sorted(VALID)
    for field in count_fields(name)
    for value in ((-1, 2.5) if zero_allowed(name, field) else (0, -1, 2.5))
]


def test_every_registered_model_has_a_valid_config_here():
    assert sorted(VALID) == models.names()
    for name, config in VALID.items():
        models.build(name, **config)  # valid: builds


def test_every_model_has_its_counts_checked():
    """The cases cover the counts that matter for each backbone."""
    covered = {(name, field) for name, field, _ in CASES}
    for name in VALID:
        for field in ("emb_features", "num_layers", "num_heads", "mlp_features"):
            assert (name, field) in covered
    for name in ("causal_transformer", "transformer"):
        assert {(name, "max_seq_len"), (name, "vocab_size"), (name, "num_kv_heads")} <= covered
    for name in ("vit", "vit_classifier", "vit_predictor", "dit", "video_dit"):
        assert (name, "patch_size") in covered


@pytest.mark.parametrize("name, field, value", CASES)
def test_a_bad_count_is_refused_when_built_with_field_value_and_range(name, field, value):
    cls = models.get(name)
    with pytest.raises(ValueError) as error:
        models.build(name, **{**VALID[name], field: value})
    message = str(error.value)
    if name in ("dit", "video_dit") and field == "sample_size":
        assert f"{cls.__name__} sample_size={value!r} must be a whole number >= 1" in message
        return
    minimum = 0 if zero_allowed(name, field) else 1
    assert message.startswith(f"{cls.__name__} got an invalid count: {field}={value!r}")
    assert f"must be a whole number >= {minimum}" in message
    assert f"Set {field} in range" in message


def test_every_bad_count_is_named_in_one_message():
    with pytest.raises(ValueError) as error:
        models.build("causal_transformer", **{**TINY_LM, "vocab_size": 0, "num_heads": 0})
    message = str(error.value)
    assert "num_heads=0 (attention heads) must be a whole number >= 1" in message
    assert "vocab_size=0 (token ids) must be a whole number >= 1" in message
    assert "Set num_heads, vocab_size in range" in message


def test_an_optional_count_names_what_none_means():
    with pytest.raises(ValueError, match=r"num_kv_heads=0 \(key/value heads; None = num_heads\)"):
        models.build("causal_transformer", **{**TINY_LM, "num_kv_heads": 0})


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "causal_transformer",
            dict(num_kv_heads=3),
            r"CausalTransformer num_heads 4 is not a multiple of num_kv_heads 3 .*use "
            r"num_kv_heads in \[1, 2, 4\]",
        ),
        (
            "transformer",
            dict(emb_features=18, num_kv_heads=None),
            "Transformer emb_features 18 does not divide over num_heads 4; use a multiple of "
            "num_heads or set head_dim",
        ),
        ("vit", dict(emb_features=18), "ViT emb_features 18 does not divide over num_heads 4"),
        (
            "dit",
            dict(emb_features=20, num_heads=3),
            "DiT emb_features 20 does not divide over num_heads 3",
        ),
        (
            "dit",
            dict(emb_features=18),
            "DiT emb_features 18 must be a multiple of 4 .*use 16 or 20",
        ),
        ("causal_transformer", dict(norm="batch"), r"unknown norm 'batch'; use one of \('rms'"),
        ("vit", dict(mlp_activation="gleu"), "ViT has unknown mlp_activation 'gleu'"),
        ("dit", dict(mlp_activation="gleu"), "DiT has unknown mlp_activation 'gleu'"),
        (
            "causal_transformer",
            dict(num_experts=4, experts_per_token=5),
            "experts_per_token 5 must be between 1 and num_experts 4",
        ),
    ],
)
def test_inconsistent_options_are_refused_when_built(name, changes, message):
    with pytest.raises(ValueError, match=message):
        models.build(name, **{**VALID[name], **changes})


def test_a_saved_config_with_a_zero_count_is_refused_by_build():
    """A config as a checkpoint stores it (JSON: dtypes as dicts) with vocab_size 0."""
    name, config = models.config_of(models.build("causal_transformer", **TINY_LM))
    with pytest.raises(ValueError, match="vocab_size=0 .*must be a whole number >= 1"):
        models.build(name, **{**config, "vocab_size": 0})


@pytest.mark.parametrize("name", sorted(VALID))
def test_every_count_accepts_numpy_integers(name):
    """A count given as a numpy integer or a 0-d array builds the same model (issue 42)."""
    cls = models.get(name)
    for field in count_fields(name):
        value = VALID[name].get(field, None)
        if value is None:
            value = next(f.default for f in dataclasses.fields(cls) if f.name == field)
        if value is None or isinstance(value, tuple):
            continue
        for form in (np.int64, np.int32, np.array):
            models.build(name, **{**VALID[name], field: form(value)})


def test_numbers_in_every_numeric_form():
    from dew.nn.keywords import is_real_number, is_whole_number, real_number, whole_number

    for value in (3, np.int64(3), np.int8(3), np.uint16(3), np.array(3)):
        assert is_whole_number(value) and is_real_number(value)
        assert whole_number(value, "n", low=1) == 3 and type(whole_number(value, "n")) is int
    for value in (0.5, np.float32(0.5), np.float16(0.5), np.array(0.5)):
        assert is_real_number(value) and not is_whole_number(value)
        assert real_number(value, "x", low=0, high=1) == 0.5
    for value in (True, np.bool_(False), np.array(True), "3", None, 1j, [3], np.zeros(2)):
        assert not is_whole_number(value) and not is_real_number(value), value
    for value in (float("nan"), np.float32("inf"), -np.inf):
        assert not is_real_number(value)
    with pytest.raises(
        ValueError, match=r"^W: x=1.5 must be a finite number in \[0, 1\) \(a share\)$"
    ):
        real_number(1.5, "x", low=0, high=1, high_open=True, meaning="a share", what="W")
    with pytest.raises(ValueError, match=r"^n=0 must be a whole number >= 1$"):
        whole_number(0, "n", low=1)


@pytest.mark.parametrize("name", sorted(VALID))
def test_every_float_option_accepts_numpy_floats(name):
    """Every float option of a backbone (norm_eps, rope_theta, init_std, ...), given as
    a numpy float or a 0-d array of a valid value, builds with that value (issue 42:
    numbers in every numeric form)."""
    cls = models.get(name)
    checked = 0
    for field in dataclasses.fields(cls):
        value = VALID[name].get(field.name, field.default)
        if isinstance(value, bool) or not isinstance(value, float):
            continue
        for form in (np.float32, np.float64, np.array):
            built = models.build(name, **{**VALID[name], field.name: form(value)})
            assert float(getattr(built, field.name)) == pytest.approx(value, rel=1e-6)
        checked += 1
    assert checked > 0, name
