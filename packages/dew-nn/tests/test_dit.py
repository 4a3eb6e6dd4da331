"""DiT and VideoDiT against a numpy forward pass written from the papers (patchify,
sinusoidal timestep and 2-D positions, adaLN-Zero blocks with cross-attention,
the final layer, unpatchify; Latte's spatial-then-temporal pairs), plus the
identities: scan == loop, a one-frame VideoDiT == the DiT of its spatial
weights, the same weights on clips of different lengths, adaLN-Zero's zero
output and identity blocks at initialisation; and the errors before compiling.
"""

from __future__ import annotations

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from dew.nn import DiT, VideoDiT, hf, models
from dew.nn.testing import TINY_DIT

TOLERANCE = 2e-5  # float32 against float64 numpy
BASE = TINY_DIT
IMAGE = dict(BASE, num_classes=5, learn_sigma=True)
VIDEO = dict(BASE, num_layers=1, num_classes=5, context_features=6, mlp_norm_eps=1e-5)
SAME = dict(rtol=1e-5, atol=1e-5)  # float32 programs that fuse differently
RNG = np.random.default_rng(0)
X = RNG.normal(size=(2, 8, 8, 3)).astype(np.float32)
# Timesteps where float32 angles t * w_k are exact to ~1e-6: at t ~ 1000 their rounding
# (~6e-5 rad) alone moves these random-weight outputs by ~5e-4. diffusers computes in
# float32 as well; the parity test compares at t = 999 with it.
T = np.array([3.0, 61.0], np.float32)
LABEL = np.array([1, 5], np.int32)  # 5 = the null class
CONTEXT = RNG.normal(size=(2, 4, 6)).astype(np.float32)
CONTEXT_MASK = np.array([[True, True, True, False], [True, True, True, True]])
VIDEO_X = RNG.normal(size=(2, 3, 8, 8, 3)).astype(np.float32)


def randomized(params, seed, scale=0.3):
    """Every parameter replaced by noise (DiT starts its modulations and head at 0)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: (scale * rng.normal(size=a.shape)).astype(np.float32), nn.unbox(params)
    )


def shapes(model, x, **keywords):
    """The parameter shapes of ``model`` (traced, nothing computed)."""
    return jax.eval_shape(
        lambda k, x, kw: model.init(k, x, jnp.zeros(x.shape[0]), **kw),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
        jax.ShapeDtypeStruct(x.shape, jnp.float32),
        {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in keywords.items()},
    )["params"]


def to_numpy(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ---------------------------------------------------------------- numpy reference


def np_layer_norm(x, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_heads(x, p, name):
    return np.einsum("bne,ehd->bnhd", x, p[f"{name}_kernel"]) + p[f"{name}_bias"]


def np_attention(queries_from, keys_from, p, key_mask=None):
    q, k, v = (np_heads(queries_from, p, "query"), np_heads(keys_from, p, "key"),
               np_heads(keys_from, p, "value"))  # fmt: skip
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = np.where(key_mask[:, None, None, :], scores, -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", np_softmax(scores), v)
    return np.einsum("bqhd,hde->bqe", out, p["out_kernel"]) + p["out_bias"]


def np_block(x, cond, p, *, eps, mlp_eps, context=None, context_mask=None, pos=None):
    """One adaLN-Zero block (Peebles & Xie, 2023, Fig. 3) on ``x [b, n, e]``."""
    mod = cond @ p["modulation"]["kernel"] + p["modulation"]["bias"]
    shift1, scale1, gate1, shift2, scale2, gate2 = np.split(mod, 6, axis=-1)
    h = np_layer_norm(x, eps) * (1 + scale1[:, None]) + shift1[:, None]
    if pos is not None:
        h = h + pos[None]
    x = x + gate1[:, None] * np_attention(h, h, p["attention"])
    if context is not None:
        x = x + np_attention(np_layer_norm(x, eps), context, p["cross_attention"], context_mask)
    h = np_layer_norm(x, mlp_eps) * (1 + scale2[:, None]) + shift2[:, None]
    up = np_gelu_tanh(h @ p["mlp"]["up"]["kernel"] + p["mlp"]["up"]["bias"])
    return x + gate2[:, None] * (up @ p["mlp"]["down"]["kernel"] + p["mlp"]["down"]["bias"])


def np_timestep(t, features=256, shift=1.0):
    half = features // 2
    freqs = np.exp(-math.log(10000) * np.arange(half) / (half - shift))
    return np.concatenate([np.cos(t[:, None] * freqs), np.sin(t[:, None] * freqs)], -1)


def np_sincos(n, coordinate, features):
    """``[sin(c w_k)..., cos(c w_k)...]``, ``w_k = 10000^(-k / (features / 2))``."""
    w = 1.0 / 10000 ** (np.arange(features // 2) / (features / 2))
    return np.concatenate([np.sin(coordinate * w), np.cos(coordinate * w)])


def np_patches(x, p):
    """``[b, H, W, C] -> [b, patches, p*p*C]``, one patch at a time, row-major."""
    b, height, width, _ = x.shape
    return np.stack(
        [
            x[:, r : r + p, c : c + p].reshape(b, -1)
            for r in range(0, height, p)
            for c in range(0, width, p)
        ],
        axis=1,
    )


def np_image(tokens, p, height, width):
    b, _, features = tokens.shape
    channels = features // (p * p)
    out = np.zeros((b, height, width, channels))
    index = 0
    for r in range(0, height, p):
        for c in range(0, width, p):
            out[:, r : r + p, c : c + p] = tokens[:, index].reshape(b, p, p, channels)
            index += 1
    return out


def np_embed(x, params, e, p):
    """Patches embedded plus their 2-D positions (columns in the first half)."""
    rows, cols = x.shape[1] // p, x.shape[2] // p
    pos = np.stack(
        [
            np.concatenate([np_sincos(0, c, e // 2), np_sincos(0, r, e // 2)])
            for r in range(rows)
            for c in range(cols)
        ]
    )
    return np_patches(x, p) @ params["patch_embed"]["kernel"] + params["patch_embed"]["bias"] + pos


def np_condition(params, t, label):
    h = np_timestep(t) @ params["time_in"]["kernel"] + params["time_in"]["bias"]
    c = np_silu(h) @ params["time_out"]["kernel"] + params["time_out"]["bias"]
    if label is not None:
        c = c + params["label_embed"][label]
    return np_silu(c)


def np_final(h, cond, params, eps=1e-6):
    mod = cond @ params["final_modulation"]["kernel"] + params["final_modulation"]["bias"]
    shift, scale = np.split(mod, 2, axis=-1)
    h = np_layer_norm(h, eps) * (1 + scale[:, None]) + shift[:, None]
    return h @ params["head"]["kernel"] + params["head"]["bias"]


def layer(params, i):
    return jax.tree.map(lambda a: a[i], params["layers"])


def np_dit(params, x, t, label, *, num_layers, blocks=True):
    params = to_numpy(params)
    e, p = params["patch_embed"]["kernel"].shape[1], 2
    cond = np_condition(params, t, label)
    h = np_embed(x.astype(np.float64), params, e, p)
    for i in range(num_layers if blocks else 0):
        h = np_block(h, cond, layer(params, i), eps=1e-6, mlp_eps=1e-6)
    return np_image(np_final(h, cond, params), p, x.shape[1], x.shape[2])


def np_video_dit(params, x, t, label, context, context_mask, *, num_layers):
    """Latte variant 1: spatial blocks over a frame's patches, temporal over a patch's
    frames (with 1-D sine-cosine frame positions added to the modulated input)."""
    params = to_numpy(params)
    b, f, height, width, _ = x.shape
    e, p = params["patch_embed"]["kernel"].shape[1], 2
    cond = np_condition(params, t, label)
    h = np.stack([np_embed(x[:, j].astype(np.float64), params, e, p) for j in range(f)], 1)
    n = h.shape[2]
    frame_pos = np.stack([np_sincos(0, j, e) for j in range(f)])
    for i in range(num_layers):
        pair = layer(params, i)
        h = np.stack(
            [
                np_block(h[:, j], cond, pair["spatial"], eps=1e-6, mlp_eps=1e-5,
                         context=context, context_mask=context_mask)
                for j in range(f)
            ],
            1,
        )  # fmt: skip
        if f > 1:
            h = np.stack(
                [
                    np_block(h[:, :, k], cond, pair["temporal"], eps=1e-6, mlp_eps=1e-5,
                             pos=frame_pos)
                    for k in range(n)
                ],
                2,
            )  # fmt: skip
    return np.stack(
        [np_image(np_final(h[:, j], cond, params), p, height, width) for j in range(f)], 1
    )


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def image():
    model = DiT(**IMAGE)
    params = jax.jit(lambda k: model.init(k, X, T, label=LABEL))(jax.random.key(0))["params"]
    apply = jax.jit(lambda p, x, t, y: model.apply({"params": p}, x, t, label=y))
    return model, params, apply


@pytest.fixture(scope="module")
def video():
    model = VideoDiT(**VIDEO)
    # traced on one frame: the temporal blocks' parameters exist all the same
    params = shapes(model, VIDEO_X[:, :1], label=LABEL, context=CONTEXT, context_mask=CONTEXT_MASK)
    apply = jax.jit(
        lambda p, x, t, y, c, m: model.apply(
            {"params": p}, x, t, label=y, context=c, context_mask=m
        )
    )
    return model, params, apply


# ---------------------------------------------------------------- tests


def test_dit_matches_numpy(image):
    model, params, apply = image
    params = randomized(params, 0)
    out = np.asarray(apply(params, X, T, LABEL))
    assert out.shape == (2, 8, 8, 6)  # learn_sigma: 2 * in_channels
    want = np_dit(params, X, T, LABEL, num_layers=2)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)


def test_dit_init_outputs_zero_and_blocks_are_identity(image):
    model, params, apply = image
    np.testing.assert_array_equal(np.asarray(apply(params, X, T, LABEL)), 0.0)
    # only the final layer random: adaLN-Zero's gates (0) make every block the identity
    flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
    noise = traverse_util.flatten_dict(randomized(params, 3), sep="/")
    head = {k: noise[k] if k.startswith(("final_", "head")) else v for k, v in flat.items()}
    head = traverse_util.unflatten_dict(head, sep="/")
    want = np_dit(head, X, T, LABEL, num_layers=2, blocks=False)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(apply(head, X, T, LABEL)), want, atol=TOLERANCE)


def test_scan_equals_loop(image):
    model, params, apply = image
    params = randomized(params, 1)
    looped = DiT(**IMAGE, use_scan=False, use_remat=True)
    loop_params = {k: v for k, v in params.items() if k != "layers"}
    for i in range(IMAGE["num_layers"]):
        loop_params[f"layer_{i}"] = layer(params, i)
    out = jax.jit(lambda p: looped.apply({"params": p}, X, T, label=LABEL))(loop_params)
    np.testing.assert_allclose(out, apply(params, X, T, LABEL), **SAME)


def test_video_dit_matches_numpy_for_any_frame_count(video):
    model, params, apply = video
    params = randomized(params, 2)
    for frames in (3, 2):  # the same weights; frame positions computed per call
        x = VIDEO_X[:, :frames]
        out = np.asarray(apply(params, x, T, LABEL, CONTEXT, CONTEXT_MASK))
        assert out.shape == x.shape
        want = np_video_dit(params, x, T, LABEL, CONTEXT, CONTEXT_MASK, num_layers=1)
        np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=TOLERANCE)
    # the temporal blocks mix frames: the first frame's output depends on the others
    other = VIDEO_X.copy()
    other[:, 1:] = 0
    changed = np.asarray(apply(params, other, T, LABEL, CONTEXT, CONTEXT_MASK))[:, 0]
    assert (
        np.abs(
            changed - np.asarray(apply(params, VIDEO_X, T, LABEL, CONTEXT, CONTEXT_MASK))[:, 0]
        ).max()
        > 1e-3
    )


def test_one_frame_video_is_the_dit_of_its_spatial_weights(video):
    model, params, apply = video
    params = randomized(params, 4)
    image_params = {k: v for k, v in params.items() if k != "layers"}
    image_params["layers"] = params["layers"]["spatial"]
    want = jax.jit(DiT(**VIDEO).apply)(
        {"params": image_params}, X, T, label=LABEL, context=CONTEXT, context_mask=CONTEXT_MASK
    )
    one_frame = apply(params, X[:, None], T, LABEL, CONTEXT, CONTEXT_MASK)
    assert one_frame.shape == (2, 1, 8, 8, 3)
    np.testing.assert_allclose(one_frame[:, 0], want, **SAME)
    as_image = apply(params, X, T, LABEL, CONTEXT, CONTEXT_MASK)  # a 4-D batch: one frame
    assert as_image.shape == (2, 8, 8, 3)
    np.testing.assert_allclose(as_image, want, **SAME)


def test_registry_round_trip_through_json():
    model = models.build("dit", **{**IMAGE, "sample_size": (8, 12)})
    name, config = models.config_of(model)
    rebuilt = models.build(name, **json.loads(json.dumps(config)))
    assert rebuilt == model and rebuilt.sample_shape == (8, 12)
    video = models.build("video_dit", **VIDEO, num_frames=4)
    name, config = models.config_of(video)
    assert models.build(name, **config) == video


@pytest.mark.parametrize(
    "model, shape, keywords, message",
    [
        (DiT(**BASE), (2, 3, 8, 8, 3), {}, "takes images"),
        (VideoDiT(**BASE), (2, 8, 8), {}, "takes videos"),
        (DiT(**BASE), (2, 8, 7, 3), {}, "does not divide into 2x2 patches"),
        (DiT(**BASE), (2, 8, 8, 4), {}, "in_channels=3"),
        (DiT(**BASE), (2, 8, 8, 3), {"label": LABEL}, "num_classes=0"),
        (DiT(**BASE), (2, 8, 8, 3), {"context": CONTEXT}, "context_features=0"),
        (DiT(**VIDEO), (2, 8, 8, 3), {}, "got no context"),
        (DiT(**VIDEO), (2, 8, 8, 3), {"context": CONTEXT[..., :5]}, "context_features=6"),
    ],
)
def test_bad_input_is_refused_before_compiling(model, shape, keywords, message):
    with pytest.raises(ValueError, match=message):
        shapes(model, np.zeros(shape, np.float32), **keywords)


def test_a_sample_size_off_the_patch_grid_is_refused_when_built():
    with pytest.raises(
        ValueError, match="DiT sample_size 9 is not a positive multiple of patch_size 2"
    ):
        DiT(**{**BASE, "sample_size": 9})


def test_diffusers_format_round_trips_config_and_tensors(image):
    model, params, _ = image
    dit = models.build("dit", **{**IMAGE, "mlp_features": 64, "mlp_norm_eps": 1e-5})
    config = hf.DIT.config_from_dew(dit)
    assert config["_class_name"] == "DiTTransformer2DModel" and config["out_channels"] == 6
    name, options = hf.DIT.config_to_dew(config)
    assert models.build(name, **options) == dit
    params = randomized(shapes(dit, X, label=LABEL), 5)
    tensors = hf.DIT.params_to_hf(params, dit)
    assert tensors[
        "transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight"
    ].shape == (6, 16)
    back = hf.DIT.params_from_hf(tensors, dit)
    jax.tree.map(np.testing.assert_array_equal, back, to_numpy(params))
    with pytest.raises(ValueError, match="cannot hold this DiT.*mlp_features"):
        hf.DIT.config_from_dew(model)  # mlp_features 24, not 4 * 16


def test_unsupported_diffusers_class_names_the_supported():
    with pytest.raises(ValueError, match="'UNet2DModel' is not supported.*DiTTransformer2DModel"):
        hf.family_of({"_class_name": "UNet2DModel"})
    assert hf.family_of({"_class_name": "DiTTransformer2DModel"}) == "dit"
