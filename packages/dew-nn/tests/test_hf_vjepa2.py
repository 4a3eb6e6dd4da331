"""The ``vjepa2`` format (transformers' ``VJEPA2Model`` encoder <-> ViT with
rotary positions) without transformers: the Conv3d patch embedding against a
numpy convolution, config and tensors both directions, the predictor skipped,
and the errors. Parity with transformers itself is
``dew-sampling/tests/parity/test_vjepa2_parity.py``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import ViT, hf, models

RNG = np.random.default_rng(0)
VIDEO = RNG.normal(size=(2, 4, 8, 8, 3)).astype(np.float32)
CONFIG = {
    "architectures": ["VJEPA2Model"],
    "model_type": "vjepa2",
    "crop_size": 8,
    "patch_size": 4,
    "frames_per_clip": 4,
    "tubelet_size": 2,
    "hidden_size": 24,
    "in_chans": 3,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "mlp_ratio": 4.0,
    "layer_norm_eps": 1e-6,
    "qkv_bias": True,
    "hidden_act": "gelu",
    "drop_path_rate": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "num_pooler_layers": 3,
    "pred_hidden_size": 16,
    "pred_num_attention_heads": 2,
    "pred_num_hidden_layers": 1,
    "pred_num_mask_tokens": 10,
    "pred_zero_init_mask_tokens": True,
    "pred_mlp_ratio": 4.0,
    "dtype": "float32",
    "transformers_version": "5.0.0",
}


def vit(**overrides):
    config = dict(
        emb_features=24,
        num_layers=2,
        num_heads=2,
        mlp_features=96,
        image_size=8,
        patch_size=4,
        num_frames=4,
        tubelet_size=2,
        position_embedding="rope",
        mlp_activation="gelu_exact",
        norm_eps=1e-6,
    )
    return ViT(**{**config, **overrides})


def init(model):
    params = nn.unbox(model.init(jax.random.key(0), jnp.asarray(VIDEO)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return jax.tree.unflatten(
        tree, [np.asarray(x + 0.1 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    )


def test_patch_embedding_is_the_conv3d():
    """transformers' Conv3d (kernel = stride = (tubelet, patch, patch)) over
    [batch, channels, frames, H, W], one output at a time, equals Dew's
    patch_embed over the tubelets of the [batch, frames, H, W, C] video."""
    model = vit()
    weight = RNG.normal(size=(24, 3, 2, 4, 4))
    (kernel,) = hf.get("vjepa2").layout(model).globals[0].to_dew(weight)
    ncthw = VIDEO.transpose(0, 4, 1, 2, 3).astype(np.float64)
    conv = np.zeros((2, 24, 2, 2, 2))
    for b, e, t, i, j in np.ndindex(*conv.shape):
        block = ncthw[b, :, 2 * t : 2 * t + 2, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4]
        conv[b, e, t, i, j] = np.sum(weight[e] * block)
    got = np.asarray(model.patchify(jnp.asarray(VIDEO)), np.float64) @ kernel
    # transformers flattens the conv output (T, H, W) row-major: Dew's patch order
    np.testing.assert_allclose(got, conv.reshape(2, 24, 8).transpose(0, 2, 1), atol=1e-10)
    back = hf.get("vjepa2").layout(model).globals[0].to_hf(kernel)
    np.testing.assert_array_equal(back, weight)


def test_config_and_tensors_round_trip():
    fmt = hf.get("vjepa2")
    assert hf.family_of(CONFIG) == "vjepa2" and fmt.architecture == "VJEPA2Model"
    name, options = fmt.config_to_dew(CONFIG)
    model = models.build(name, **options)
    assert model == vit()
    written = fmt.config_from_dew(model, base=CONFIG)
    assert written == CONFIG  # nothing lost or changed
    assert fmt.config_to_dew(fmt.config_from_dew(model)) == (name, options)
    params = init(model)
    tensors = fmt.params_to_hf(params, model)
    assert tensors["encoder.embeddings.patch_embeddings.proj.weight"].shape == (24, 3, 2, 4, 4)
    assert tensors["encoder.layer.1.attention.proj.weight"].shape == (24, 24)
    assert tensors["encoder.layer.0.mlp.fc1.weight"].shape == (96, 24)
    assert not any(k.startswith("predictor.") for k in tensors)
    # a checkpoint with its predictor loads the encoder; the predictor is skipped
    predictor = {
        "predictor.embeddings.mask_tokens": np.zeros((10, 1, 1, 16), np.float32),
        "predictor.layer.0.attention.query.weight": np.zeros((16, 16), np.float32),
    }
    back = fmt.params_from_hf({**tensors, **predictor}, model)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    looped = fmt.params_from_hf(tensors, model.clone(use_scan=False))
    np.testing.assert_array_equal(
        looped["layer_1"]["attention"]["query_kernel"],
        params["layers"]["attention"]["query_kernel"][1],
    )


def test_the_hub_config_fields_load():
    """Fields of facebook/vjepa2-vitl-fpc64-256's config.json that transformers
    does not read (the size is crop_size; the MLP is hidden_act)."""
    hub = dict(CONFIG, image_size=256, hidden_dropout_prob=0.0, use_SiLU=False, wide_SiLU=True)
    assert hf.get("vjepa2").config_to_dew(hub) == hf.get("vjepa2").config_to_dew(CONFIG)
    with pytest.raises(ValueError, match=r"use_SiLU=True.*supported: False"):
        hf.get("vjepa2").config_to_dew(dict(hub, use_SiLU=True))


def test_a_non_integer_mlp_ratio_round_trips():
    fmt = hf.get("vjepa2")
    model = vit(mlp_features=40)
    config = fmt.config_from_dew(model)
    assert config["mlp_ratio"] == 40 / 24
    assert fmt.config_to_dew(config)[1]["mlp_features"] == 40


def test_errors_name_what_is_unsupported():
    fmt = hf.get("vjepa2")
    with pytest.raises(ValueError, match=r"VJEPA2ForVideoClassification.*loads VJEPA2Model"):
        fmt.config_to_dew(dict(CONFIG, architectures=["VJEPA2ForVideoClassification"]))
    with pytest.raises(ValueError, match="qkv_bias=False"):
        fmt.config_to_dew(dict(CONFIG, qkv_bias=False))
    with pytest.raises(ValueError, match=r"patch_size=\[4, 4\]; .* one int"):
        fmt.config_to_dew(dict(CONFIG, patch_size=[4, 4]))
    with pytest.raises(ValueError, match=r"'use_rope_v2'.*ignore_fields"):
        fmt.config_to_dew(dict(CONFIG, use_rope_v2=True))
    with pytest.raises(ValueError, match=r"position_embedding='rope' \(the model has 'sincos'\)"):
        fmt.config_from_dew(vit(position_embedding="sincos"))
    with pytest.raises(ValueError, match=r"num_frames=a number of frames.*format='dew'"):
        fmt.config_from_dew(vit(num_frames=None, tubelet_size=1))
    tensors = fmt.params_to_hf(init(vit()), vit())
    with pytest.raises(ValueError, match=r"pooler\.query_tokens.*architecture Dew does not"):
        fmt.params_from_hf({**tensors, "pooler.query_tokens": np.zeros((1, 1, 24))}, vit())
