"""ViT and ViTPredictor against numpy: patches, the sine-cosine tables, the
encoder and the predictor; the identities (a subset of positions == the model
run on those patches alone, permuted positions == the permuted output, scan ==
loop, remat == plain); and the errors raised before compiling."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import ViT, ViTClassifier, ViTPredictor, hf, models
from dew.nn.backbones.vit import PatchGrid, sincos_table
from dew.nn.testing import TINY_PREDICTOR, TINY_VIT, tiny_predictor, tiny_vit

TOLERANCE = 2e-5  # float32 against float64 numpy, a few layers deep
RNG = np.random.default_rng(0)
IMAGES = RNG.normal(size=(2, 12, 12, 3)).astype(np.float32)
VIDEO = RNG.normal(size=(2, 4, 8, 8, 3)).astype(np.float32)
VIDEO_CONFIG = dict(image_size=8, num_frames=4, tubelet_size=2)


def init(model, *inputs):
    """Initial parameters shifted by noise, so biases, scales and the mask token matter."""
    params = nn.unbox(model.init(jax.random.key(0), *map(jnp.asarray, inputs)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )


# ------------------------------------------------------------------ numpy reference


def np_patches(pixels, patch, tubelet=1):
    """One patch at a time: patch n = (t, i, j) row-major, its values in (frame, row,
    column, channel) order."""
    video = pixels if pixels.ndim == 5 else pixels[:, None]
    b, f, h, w, _ = video.shape
    out = []
    for t in range(f // tubelet):
        for i in range(h // patch):
            for j in range(w // patch):
                block = video[
                    :,
                    t * tubelet : (t + 1) * tubelet,
                    i * patch : (i + 1) * patch,
                    j * patch : (j + 1) * patch,
                ]
                out.append(block.reshape(b, -1))
    return np.stack(out, 1)


def np_sincos(features, grid_shape):
    """The I-JEPA / V-JEPA formulas, one entry at a time."""
    out = np.zeros((int(np.prod(grid_shape)), features))

    def put(n, offset, width, coordinate):
        for k in range(width // 2):
            angle = coordinate / 10000 ** (2 * k / width)
            out[n, offset + k] = math.sin(angle)
            out[n, offset + width // 2 + k] = math.cos(angle)

    for n, index in enumerate(np.ndindex(*grid_shape)):
        if len(grid_shape) == 2:  # columns first, then rows
            put(n, 0, features // 2, index[1])
            put(n, features // 2, features // 2, index[0])
        else:  # time (half), rows (a quarter), columns (a quarter)
            put(n, 0, features // 2, index[0])
            put(n, features // 2, features // 4, index[1])
            put(n, 3 * features // 4, features // 4, index[2])
    return out


_erf = np.vectorize(math.erf)


def np_layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * p["scale"] + p[
        "bias"
    ]


def np_blocks(model, p, x):
    """Pre-norm blocks (full attention, erf GELU, biases) and the final norm."""
    heads = model.num_heads
    dim = model.emb_features // heads
    for i in range(model.num_layers):
        L = jax.tree.map(lambda a, i=i: np.asarray(a[i], np.float64), p["layers"])
        a = L["attention"]
        h = np_layer_norm(x, L["attention_norm"], model.norm_eps)
        q, k, v = (
            np.einsum("bte,ehd->bthd", h, a[f"{n}_kernel"]) + a[f"{n}_bias"]
            for n in ("query", "key", "value")
        )
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", w, v)
        x = x + np.einsum("bqhd,hde->bqe", o, a["out_kernel"]) + a["out_bias"]
        h = np_layer_norm(x, L["mlp_norm"], model.norm_eps)
        m = L["mlp"]
        up = h @ m["up"]["kernel"] + m["up"]["bias"]
        x = x + 0.5 * up * (1 + _erf(up / np.sqrt(2))) @ m["down"]["kernel"] + m["down"]["bias"]
    return np_layer_norm(x, jax.tree.map(np.asarray, p["final_norm"]), model.norm_eps)


def np_table(model, p):
    if model.position_embedding == "learned":
        return np.asarray(p["position_embed"], np.float64)
    return np_sincos(model.emb_features, model.grid.shape)


def np_vit(model, params, pixels, positions=None):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    patches = np_patches(np.asarray(pixels, np.float64), model.patch_size, model.tubelet_size)
    if positions is None:
        positions = np.broadcast_to(np.arange(patches.shape[1]), patches.shape[:2])
    patches = np.stack([patches[b, positions[b]] for b in range(len(patches))])
    x = patches @ p["patch_embed"]["kernel"] + p["patch_embed"]["bias"]
    return np_blocks(model, p, x + np_table(model, p)[positions])


def np_predictor(model, params, context, context_positions, target_positions):
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    table = np_table(model, p)
    x = context @ p["input_projection"]["kernel"] + p["input_projection"]["bias"]
    x = x + table[context_positions]
    targets = p["mask_token"] + table[target_positions]
    x = np_blocks(model, p, np.concatenate([x, targets], 1))[:, context.shape[1] :]
    return x @ p["output_projection"]["kernel"] + p["output_projection"]["bias"]


# ------------------------------------------------------------------ patches and tables


@pytest.mark.parametrize("video", [False, True], ids=["image", "video"])
def test_patchify_is_the_numpy_cut_and_unpatchify_inverts_it(video):
    grid = (
        PatchGrid(**VIDEO_CONFIG, patch_size=4) if video else PatchGrid(image_size=12, patch_size=4)
    )
    pixels = VIDEO if video else IMAGES
    patches = grid.patchify(jnp.asarray(pixels))
    np.testing.assert_array_equal(patches, np_patches(pixels, 4, grid.tubelet_size))
    np.testing.assert_array_equal(grid.unpatchify(patches, 3), pixels)


@pytest.mark.parametrize("grid_shape", [(3, 4), (2, 3, 2)], ids=["2d", "3d"])
def test_sincos_table_matches_the_formula(grid_shape):
    np.testing.assert_allclose(sincos_table(16, grid_shape), np_sincos(16, grid_shape), atol=1e-6)


# ------------------------------------------------------------------ the encoder


@pytest.fixture(scope="module")
def vit():
    model = tiny_vit()
    return model, init(model, IMAGES)


@pytest.mark.parametrize("position_embedding", ["sincos", "learned"])
def test_vit_matches_numpy(position_embedding):
    model = tiny_vit(position_embedding=position_embedding)
    params = init(model, IMAGES)
    got = model.apply({"params": params}, jnp.asarray(IMAGES))
    np.testing.assert_allclose(got, np_vit(model, params, IMAGES), atol=TOLERANCE, rtol=0)


def test_video_tubelets_match_numpy():
    model = tiny_vit(**VIDEO_CONFIG)
    params = init(model, VIDEO)
    got = model.apply({"params": params}, jnp.asarray(VIDEO))
    assert got.shape == (2, model.num_patches, 16) and model.grid.shape == (2, 2, 2)
    np.testing.assert_allclose(got, np_vit(model, params, VIDEO), atol=TOLERANCE, rtol=0)


def test_a_subset_of_positions_sees_only_those_patches(vit):
    """The context encoder: kept patches only, different per row, as numpy on
    the kept patches alone; the dropped patches' pixels change nothing."""
    model, params = vit
    kept = np.array([[0, 4, 8, 2], [7, 1, 5, 3]], np.int32)
    got = model.apply({"params": params}, jnp.asarray(IMAGES), jnp.asarray(kept))
    np.testing.assert_allclose(got, np_vit(model, params, IMAGES, kept), atol=TOLERANCE, rtol=0)
    patches = model.patchify(jnp.asarray(IMAGES))
    keep = np.zeros((2, 9, 1), bool)
    keep[np.arange(2)[:, None], kept] = True
    noise = 5.0 * jnp.asarray(RNG.normal(size=patches.shape), jnp.float32)
    others = model.unpatchify(jnp.where(keep, patches, patches + noise))
    moved = model.apply({"params": params}, others, jnp.asarray(kept))
    np.testing.assert_allclose(moved, got, atol=1e-6, rtol=0)


def test_permuted_positions_permute_the_output(vit):
    model, params = vit
    full = model.apply({"params": params}, jnp.asarray(IMAGES))
    order = np.stack([RNG.permutation(9), RNG.permutation(9)]).astype(np.int32)
    got = model.apply({"params": params}, jnp.asarray(IMAGES), jnp.asarray(order))
    np.testing.assert_allclose(
        got, np.take_along_axis(np.asarray(full), order[..., None], 1), atol=1e-5, rtol=0
    )


def test_scan_equals_loop_and_remat_equals_plain(vit):
    model, params = vit
    looped = model.clone(use_scan=False)
    loop_params = {k: v for k, v in params.items() if k != "layers"}
    for i in range(model.num_layers):
        loop_params[f"layer_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    assert jax.tree.structure(loop_params) == jax.tree.structure(
        nn.unbox(looped.init(jax.random.key(0), jnp.asarray(IMAGES)))["params"]
    )
    want = model.apply({"params": params}, jnp.asarray(IMAGES))
    np.testing.assert_allclose(
        looped.apply({"params": loop_params}, jnp.asarray(IMAGES)), want, atol=1e-6, rtol=0
    )

    def loss(m, p):
        return jnp.sum(m.apply({"params": p}, jnp.asarray(IMAGES)) ** 2)

    plain = jax.grad(lambda p: loss(model, p))(params)
    remat = jax.grad(lambda p: loss(model.clone(use_remat=True), p))(params)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_pipelined_vit_equals_the_plain_stack(vit):
    """Two stages, two microbatches, different kept patches in every row."""
    model, params = vit
    images = jnp.asarray(np.concatenate([IMAGES, IMAGES[::-1]]))
    kept = jnp.asarray([[0, 4, 8, 2], [7, 1, 5, 3], [3, 2, 1, 0], [8, 6, 4, 2]], jnp.int32)
    piped = model.clone(num_stages=2, pipeline_microbatches=2)
    want = jax.jit(lambda p: model.apply({"params": p}, images, kept))(params)
    got = jax.jit(lambda p: piped.apply({"params": p}, images, kept))(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_parameters_name_logical_axes():
    model = tiny_vit(position_embedding="learned")
    boxed = model.init(jax.random.key(0), jnp.asarray(IMAGES))["params"]
    names = {
        "/".join(str(getattr(k, "key", k)) for k in path): leaf.names
        for path, leaf in jax.tree_util.tree_leaves_with_path(
            boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        )
    }
    assert names["patch_embed/kernel"] == (None, "embed")
    assert names["position_embed"] == (None, "embed")
    assert names["layers/attention/query_kernel"] == ("layers", "embed", "heads", "head_dim")
    assert names["layers/mlp/up/kernel"] == ("layers", "embed", "mlp")
    assert names["final_norm/scale"] == ("embed",)


def test_registry_round_trip():
    for name, config in (
        ("vit", dict(TINY_VIT, num_frames=4, image_size=8, tubelet_size=2)),
        ("vit_predictor", TINY_PREDICTOR),
    ):
        model = models.build(name, **config)
        name, options = models.config_of(model)
        assert models.build(name, **options) == model
    assert isinstance(models.build("vit", **TINY_VIT), ViT)
    assert isinstance(models.build("vit_predictor", **TINY_PREDICTOR), ViTPredictor)


# ------------------------------------------------------------------ the classifier


def test_classifier_is_the_pooled_encoder_and_a_head_and_scales_uint8():
    """``vit_classifier``: numpy's encoder features, averaged over the patches, times
    the head; uint8 pixels are read as ``p / 127.5 - 1`` (the JEPA objective's scale),
    so a JEPA-trained ``vit``'s weights start it; it round-trips the registry."""
    model = models.build("vit_classifier", **TINY_VIT, num_classes=5)
    assert isinstance(model, ViTClassifier) and isinstance(model, ViT)
    name, options = models.config_of(model)
    assert models.build(name, **options) == model
    params = init(model, IMAGES)
    assert set(params) - set(init(tiny_vit(), IMAGES)) == {"head"}
    got = model.apply({"params": params}, jnp.asarray(IMAGES))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params["head"])
    want = np_vit(model, params, IMAGES).mean(1) @ p["kernel"] + p["bias"]
    assert got.shape == (2, 5) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    pixels = RNG.integers(0, 256, size=IMAGES.shape).astype(np.uint8)
    np.testing.assert_allclose(
        model.apply({"params": params}, jnp.asarray(pixels)),
        model.apply({"params": params}, jnp.asarray(pixels / 127.5 - 1.0, jnp.float32)),
        atol=1e-6,
    )
    boxed = model.init(jax.random.key(0), jnp.asarray(IMAGES))["params"]
    assert boxed["head"]["kernel"].names == ("embed", None)


# ------------------------------------------------------------------ the predictor

CONTEXT_POSITIONS = np.array([[0, 2, 4, 6], [8, 7, 1, 3]], np.int32)
TARGET_POSITIONS = np.array([[1, 3, 5], [0, 2, 6]], np.int32)
CONTEXT = RNG.normal(size=(2, 4, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def predictor():
    model = tiny_predictor()
    return model, init(model, CONTEXT, CONTEXT_POSITIONS, TARGET_POSITIONS)


def test_predictor_matches_numpy(predictor):
    model, params = predictor
    got = model.apply(
        {"params": params}, *map(jnp.asarray, (CONTEXT, CONTEXT_POSITIONS, TARGET_POSITIONS))
    )
    assert got.shape == (2, 3, 16)
    want = np_predictor(model, params, CONTEXT, CONTEXT_POSITIONS, TARGET_POSITIONS)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_predictions_follow_the_context_not_its_order(predictor):
    model, params = predictor

    def predict(context, context_positions, target_positions=TARGET_POSITIONS):
        return np.asarray(
            model.apply(
                {"params": params},
                *map(jnp.asarray, (context, context_positions, target_positions)),
            )
        )

    base = predict(CONTEXT, CONTEXT_POSITIONS)
    order = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(
        predict(CONTEXT[:, order], CONTEXT_POSITIONS[:, order]), base, atol=1e-5, rtol=0
    )
    changed = CONTEXT.copy()
    changed[0, 1] += 1.0  # row 0 only
    moved = predict(changed, CONTEXT_POSITIONS)
    assert np.linalg.norm(moved[0] - base[0], axis=-1).min() > 1e-3  # every target of row 0
    np.testing.assert_array_equal(moved[1], base[1])
    elsewhere = predict(CONTEXT, np.array([[0, 2, 4, 8], [8, 7, 1, 3]], np.int32))
    assert np.linalg.norm(elsewhere[0] - base[0], axis=-1).min() > 1e-3  # token moved elsewhere


# ------------------------------------------------------------------ errors


def test_configuration_errors_say_what_to_do():
    with pytest.raises(ValueError, match="image_size 10 is not a multiple of patch_size 4"):
        tiny_vit(image_size=10).init(jax.random.key(0), jnp.zeros((1, 10, 10, 3)))
    with pytest.raises(
        ValueError, match="num_frames 1 is not a positive multiple of tubelet_size 2"
    ):
        PatchGrid(image_size=8, patch_size=4, num_frames=1, tubelet_size=2)
    with pytest.raises(ValueError, match="divisible by 8, got 12"):
        tiny_vit(emb_features=12, num_heads=4, **VIDEO_CONFIG).init(
            jax.random.key(0), jnp.asarray(VIDEO)
        )


def test_input_errors_are_raised_before_compiling(vit):
    model, params = vit
    with pytest.raises(ValueError, match=r"\[batch, 12, 12, 3\].*got \(2, 10, 12, 3\)"):
        jax.jit(model.apply)({"params": params}, jnp.zeros((2, 10, 12, 3)))
    video = tiny_vit(**VIDEO_CONFIG)
    with pytest.raises(ValueError, match="the video has 1 frames, the model takes num_frames=4"):
        video.init(jax.random.key(0), jnp.zeros((1, 1, 8, 8, 3)))
    with pytest.raises(ValueError, match=r"integer patch indices \[batch, K\] with batch 2"):
        model.apply({"params": params}, jnp.asarray(IMAGES), jnp.zeros((3,), jnp.int32))


# ------------------------------------------------------------------ the ijepa format


def test_ijepa_patch_embedding_is_the_conv():
    """transformers' Conv2d (kernel = stride = patch) over NCHW pixels, one output
    at a time, equals Dew's patch_embed over the patches of the NHWC image."""
    model = tiny_vit(position_embedding="learned")
    weight = RNG.normal(size=(16, 3, 4, 4))
    (kernel,) = hf.get("ijepa").layout(model).globals[0].to_dew(weight)
    nchw = IMAGES.transpose(0, 3, 1, 2).astype(np.float64)
    conv = np.zeros((2, 16, 3, 3))
    for b, e, i, j in np.ndindex(*conv.shape):
        conv[b, e, i, j] = np.sum(weight[e] * nchw[b, :, 4 * i : 4 * i + 4, 4 * j : 4 * j + 4])
    got = np.asarray(model.patchify(jnp.asarray(IMAGES)), np.float64) @ kernel
    np.testing.assert_allclose(got, conv.reshape(2, 16, 9).transpose(0, 2, 1), atol=1e-10)


def test_ijepa_config_and_tensors_round_trip():
    fmt = hf.get("ijepa")
    config = {
        "architectures": ["IJepaModel"],
        "model_type": "ijepa",
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 24,
        "image_size": [12, 12],
        "patch_size": 4,
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "qkv_bias": True,
        "pooler_output_size": 16,
        "pooler_act": "tanh",
        "initializer_range": 0.02,
    }
    assert hf.family_of(config) == "ijepa"
    name, options = fmt.config_to_dew(config)
    model = models.build(name, **options)
    assert model == tiny_vit(position_embedding="learned", norm_eps=1e-12)
    assert fmt.config_to_dew(fmt.config_from_dew(model, base=config)) == (name, options)
    params = init(model, IMAGES)
    tensors = fmt.params_to_hf(params, model)
    assert tensors["encoder.layer.1.attention.attention.query.weight"].shape == (16, 16)
    assert tensors["embeddings.position_embeddings"].shape == (1, 9, 16)
    back = fmt.params_from_hf(tensors, model)
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))
    looped = fmt.params_from_hf(tensors, model.clone(use_scan=False))
    np.testing.assert_array_equal(
        looped["layer_1"]["mlp"]["up"]["kernel"], params["layers"]["mlp"]["up"]["kernel"][1]
    )


def test_a_sincos_vit_is_written_with_its_table():
    fmt = hf.get("ijepa")
    model = tiny_vit()
    params = init(model, IMAGES)
    tensors = fmt.params_to_hf(params, model)
    np.testing.assert_allclose(
        tensors["embeddings.position_embeddings"][0], np_sincos(16, (3, 3)), atol=1e-6
    )
    back = fmt.params_from_hf(tensors, model)  # the table is checked, not kept
    assert "position_embed" not in back
    tensors["embeddings.position_embeddings"] = tensors["embeddings.position_embeddings"] + 1
    with pytest.raises(ValueError, match="not the sine-cosine table"):
        fmt.params_from_hf(tensors, model)


def test_ijepa_errors_name_what_is_unsupported():
    fmt = hf.get("ijepa")
    base = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=8)
    with pytest.raises(ValueError, match=r"'vit_mae'.*not supported.*ijepa \(IJepaModel\)"):
        hf.family_of({"model_type": "vit_mae", "architectures": ["ViTMAEModel"]})
    with pytest.raises(ValueError, match=r"image_size=\[12, 16\]; Dew's ViT takes square"):
        fmt.config_to_dew(dict(base, image_size=[12, 16]))
    with pytest.raises(ValueError, match="qkv_bias=False"):
        fmt.config_to_dew(dict(base, qkv_bias=False))
    with pytest.raises(ValueError, match=r"num_frames=None \(images\).*format='dew'"):
        fmt.config_from_dew(tiny_vit(**VIDEO_CONFIG))
