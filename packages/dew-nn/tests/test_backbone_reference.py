"""Every transformer backbone against a stored reference computed before the
shared options vocabulary (``dew.nn.backbones._options``) and the one block
module (``dew.nn.backbones.block``) replaced each backbone's own fields and
blocks: built from the config ``models.config_of`` saved then (a saved run's
config), each has the same parameter tree (paths, shapes and initial values,
so checkpoints and Hugging Face conversions still load) and the same output.

``data/backbone_reference.json`` was written by ``python
tests/test_backbone_reference.py`` on the commit before that change; rerun it
only when a change of numerics is intended (and say so in the CHANGELOG).
"""

from __future__ import annotations

import json
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import models

REFERENCE = pathlib.Path(__file__).parent / "data" / "backbone_reference.json"
TOLERANCE = 1e-6  # the same float32 operations; only their Python spelling moved

_IMAGE = dict(image_size=8, patch_size=4, emb_features=16, num_heads=2, mlp_features=24)
_DIT = dict(sample_size=8, patch_size=4, in_channels=3, emb_features=16, num_heads=2)
_LM = dict(emb_features=16, num_heads=2, mlp_features=24, max_seq_len=8)

# name -> (registry name, constructor keywords); tiny, 1-2 layers, one of each option kind
# (the Llama-style decoder and the encoder are pinned by the Hugging Face tests too)
CASES = {
    "vit_video_rope_loop": (
        "vit",
        dict(
            **{**_IMAGE, "emb_features": 24, "num_heads": 2},
            num_layers=2,
            num_frames=2,
            tubelet_size=2,
            position_embedding="rope",
            use_scan=False,
        ),
    ),
    "vit_learned_swiglu_rms": (
        "vit",
        dict(
            **_IMAGE,
            num_layers=1,
            position_embedding="learned",
            mlp_activation="swiglu",
            norm="rms",
            use_bias=False,
        ),
    ),
    "vit_predictor": ("vit_predictor", dict(**_IMAGE, num_layers=1, encoder_features=8)),
    "dit_class_context": (
        "dit",
        dict(
            **_DIT,
            num_layers=2,
            mlp_features=32,
            num_classes=3,
            context_features=6,
            learn_sigma=True,
            use_zero_init=False,
        ),
    ),
    "dit_loop_relu": (
        "dit",
        dict(
            **_DIT,
            num_layers=2,
            mlp_features=32,
            use_scan=False,
            mlp_activation="relu",
            mlp_norm_eps=1e-5,
            time_freq_shift=0.0,
            use_qkv_bias=False,
            use_zero_init=False,
        ),
    ),
    "video_dit": (
        "video_dit",
        dict(**_DIT, num_layers=1, mlp_features=32, num_frames=2, use_zero_init=False),
    ),
    "causal_gpt2": (
        "causal_transformer",
        dict(
            **_LM,
            num_layers=1,
            vocab_size=11,
            position_embedding="learned",
            norm="layer",
            mlp_activation="gelu",
            use_bias=True,
            tie_embeddings=True,
        ),
    ),
}


def _inputs(name: str, model) -> tuple[tuple, dict]:
    """Fixed inputs of one example batch (batch 2)."""
    key = jax.random.key(1)
    registry = CASES[name][0]
    if registry == "vit":
        shape = (2, *model.grid.pixel_shape(model.num_channels))
        return (jax.random.normal(key, shape),), {}
    if registry == "vit_predictor":
        context = jax.random.normal(key, (2, 2, model.encoder_features))
        return (context, jnp.array([[0, 3], [1, 2]]), jnp.array([[1, 2], [0, 3]])), {}
    if registry in ("dit", "video_dit"):
        frames = (2,) if registry == "video_dit" else ()
        x = jax.random.normal(key, (2, *frames, 8, 8, 3))
        keywords = {}
        if model.num_classes:
            keywords["label"] = jnp.array([0, 3])
        if model.context_features:
            keywords["context"] = jax.random.normal(jax.random.key(2), (2, 3, 6))
        return (x, jnp.array([10.0, 500.0])), keywords
    return (jax.random.randint(key, (2, 8), 0, 11),), {}


def _summary(model, name: str) -> dict:
    args, keywords = _inputs(name, model)

    @jax.jit
    def init_and_apply(key):  # one compiled program per case
        params = nn.unbox(model.init(key, *args, **keywords))["params"]
        return params, model.apply({"params": params}, *args, **keywords)

    params, out = init_and_apply(jax.random.key(0))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    tree = {
        jax.tree_util.keystr(path): [
            list(leaf.shape),
            float(np.sum(np.asarray(leaf, np.float64))),
            float(np.sum(np.abs(np.asarray(leaf, np.float64)))),
        ]
        for path, leaf in leaves
    }
    return {"params": tree, "output": np.asarray(out, np.float64).reshape(-1).tolist()}


def _write() -> None:
    reference = {}
    for name, (registry, keywords) in CASES.items():
        model = models.build(registry, **keywords)
        _, config = models.config_of(model)
        reference[name] = {"registry": registry, "config": config, **_summary(model, name)}
    REFERENCE.parent.mkdir(exist_ok=True)
    REFERENCE.write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("name", CASES)
def test_saved_config_builds_the_same_parameters_and_output(reference, name):
    saved = reference[name]
    model = models.build(saved["registry"], **saved["config"])
    _, config = models.config_of(model)
    # every saved option reads back as it was saved; options added since take
    # their defaults, which leave the model as it was
    assert {k: config[k] for k in saved["config"]} == saved["config"]
    got = _summary(model, name)
    assert sorted(got["params"]) == sorted(saved["params"])
    for path, (shape, total, absolute) in saved["params"].items():
        got_shape, got_total, got_absolute = got["params"][path]
        assert got_shape == shape, path
        np.testing.assert_allclose([got_total, got_absolute], [total, absolute], rtol=1e-6)
    np.testing.assert_allclose(got["output"], saved["output"], rtol=TOLERANCE, atol=TOLERANCE)


if __name__ == "__main__":
    sys.exit(_write())
