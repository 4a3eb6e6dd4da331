"""The model registry: build by name, rebuild from the stored name and config."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer, RopeScaling, models
from dew.nn.backbones import CausalTransformer as FromBackbones
from dew.nn.testing import TINY_LM

CONFIG = TINY_LM


def test_build_gives_the_registered_class():
    model = models.build("causal_transformer", **CONFIG)
    assert type(model) is CausalTransformer is FromBackbones
    assert "causal_transformer" in models.names()


def test_config_round_trips_through_json_to_an_identical_module():
    model = models.build(
        "causal_transformer",
        **CONFIG,
        dtype=jnp.bfloat16,
        rope_scaling=RopeScaling(kind="llama3", factor=8.0),
    )
    name, config = models.config_of(model)
    rebuilt = models.build(name, **json.loads(json.dumps(config)))
    assert rebuilt == model and hash(rebuilt) == hash(model)
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    a = model.init(jax.random.key(3), tokens)
    b = rebuilt.init(jax.random.key(3), tokens)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16, np.dtype("bfloat16"), np.float32])
def test_a_model_rebuilt_from_its_saved_config_equals_and_hashes_as_the_original(dtype):
    """Saved JSON decodes dtypes as np.dtype('float32'): build spells every dtype as the
    jax.numpy type, so the rebuilt module is ==, hash-equal (a compiled-program cache hit)."""
    options = {} if dtype is None else {"dtype": dtype}
    model = models.build("causal_transformer", **CONFIG, **options)
    name, config = models.config_of(model)
    rebuilt = models.build(name, **json.loads(json.dumps(config)))
    assert rebuilt == model and hash(rebuilt) == hash(model)
    want = jnp.float32 if dtype in (None, np.float32) else jnp.bfloat16
    assert rebuilt.dtype is model.dtype is want
    assert rebuilt.param_dtype is jnp.float32


def test_unknown_name_lists_registered_models():
    with pytest.raises(KeyError, match="registered models: .*causal_transformer"):
        models.build("causal_transfomer", **CONFIG)
    with pytest.raises(KeyError, match="Did you mean 'causal_transformer'"):
        models.get("causal_transfomer")


def test_unknown_option_lists_the_options():
    with pytest.raises(TypeError, match="no option.*'emb_size'.*emb_features"):
        models.build("causal_transformer", emb_size=8, **CONFIG)


def test_unregistered_module_cannot_be_saved():
    import flax.linen as nn

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x

    with pytest.raises(ValueError, match="not registered"):
        models.config_of(Plain())


def test_register_refuses_a_taken_name():
    import flax.linen as nn

    with pytest.raises(ValueError, match="already registered"):

        @models.register("causal_transformer")
        class Other(nn.Module):
            pass


def test_config_differences_lists_only_the_fields_that_differ_with_both_values():
    small = models.build("causal_transformer", **CONFIG)
    large = models.build(
        "causal_transformer", **{**CONFIG, "emb_features": 32, "num_layers": 4}, dtype=jnp.bfloat16
    )
    lines = models.config_differences(
        small, large, saved_label="the checkpoint", current_label="this run"
    )
    assert lines == [
        "dtype: float32 in the checkpoint, bfloat16 in this run",
        "emb_features: 16 in the checkpoint, 32 in this run",
        "num_layers: 2 in the checkpoint, 4 in this run",
    ]
    assert models.config_differences(small, small) == []


def test_config_differences_reads_saved_records_and_fills_unrecorded_defaults():
    model = models.build("causal_transformer", **CONFIG)
    name, config = models.config_of(model)
    saved = json.loads(json.dumps({"name": name, "config": config}))  # as a checkpoint stores it
    del saved["config"]["use_scan"]  # written before the field existed: its default
    assert models.config_differences(saved, model) == []
    saved["config"]["vocab_size"] = 64
    assert models.config_differences(saved, (name, config)) == [
        "vocab_size: 64 in the saved model, 32 in this one"
    ]
    raw = dict(CONFIG, rope_scaling=RopeScaling(kind="linear", factor=2.0), dtype=jnp.float32)
    assert models.config_differences(("causal_transformer", raw), model) == [
        'rope_scaling: {"__dataclass__": "RopeScaling", "kind": "linear", "factor": 2.0, '
        '"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192} in '
        "the saved model, null in this one"
    ]
    assert models.config_differences({"name": "vit", "config": {}}, model) == [
        "model: 'vit' in the saved model, 'causal_transformer' in this one"
    ]
