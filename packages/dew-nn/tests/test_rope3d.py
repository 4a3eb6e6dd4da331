"""The axial (N-D) rotary embedding of V-JEPA 2 against numpy, one feature at a
time; the ViT with ``position_embedding='rope'`` against a numpy encoder; the
identities (a subset of positions == those patches alone at their coordinates,
permuted positions == the permuted output); and the errors."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import ViT, ViTPredictor, masks
from dew.nn.attention import Attention
from dew.nn.rope import apply_axial_rope, axial_section_dim

RNG = np.random.default_rng(0)
VIDEO = RNG.normal(size=(2, 4, 8, 8, 3)).astype(np.float32)
TOLERANCE = 2e-5  # float32 against float64 numpy, a few layers deep


def np_axial_rope(x, coordinates, theta=10000.0):
    """V-JEPA 2's ``rotate_queries_or_keys`` per section, written out: feature ``i``
    of a section of ``S`` turns with its pair neighbour by ``c * theta^(-(i mod
    S/2) / (S/2))``."""
    x = np.asarray(x, np.float64)
    num_axes, head_dim = coordinates.shape[-1], x.shape[-1]
    section = 2 * ((head_dim // num_axes) // 2)
    half = section // 2
    out = x.copy()
    for a in range(num_axes):
        c = np.asarray(coordinates[..., a], np.float64)[..., None]  # [batch, length, 1]
        for i in range(section):
            f = a * section + i
            angle = c * theta ** (-(i % half) / half)
            partner = -x[..., f + 1] if i % 2 == 0 else x[..., f - 1]
            out[..., f] = x[..., f] * np.cos(angle) + partner * np.sin(angle)
    return out


@pytest.mark.parametrize("head_dim, num_axes", [(24, 3), (20, 3), (8, 2), (6, 3), (10, 1)], ids=str)
def test_axial_rope_matches_numpy(head_dim, num_axes):
    x = RNG.normal(size=(2, 5, 3, head_dim)).astype(np.float32)
    coordinates = RNG.integers(0, 9, size=(2, 5, num_axes))
    got = apply_axial_rope(jnp.asarray(x), jnp.asarray(coordinates))
    np.testing.assert_allclose(got, np_axial_rope(x, coordinates), atol=1e-5, rtol=0)


def test_sections_and_the_unrotated_remainder():
    assert axial_section_dim(64, 3) == 20  # V-JEPA 2 ViT-L: 3 x 20 rotated, 4 left
    assert axial_section_dim(24, 3) == 8 and axial_section_dim(20, 3) == 6
    x = RNG.normal(size=(1, 2, 1, 20)).astype(np.float32)
    got = np.asarray(apply_axial_rope(jnp.asarray(x), jnp.asarray([[[1, 2, 3], [4, 5, 6]]])))
    np.testing.assert_array_equal(got[..., 18:], x[..., 18:])
    # coordinate 0 along an axis leaves its section as it is
    got = np.asarray(apply_axial_rope(jnp.asarray(x), jnp.asarray([[[0, 2, 0], [0, 5, 0]]])))
    np.testing.assert_allclose(got[..., :6], x[..., :6], atol=0, rtol=0)
    np.testing.assert_allclose(got[..., 12:], x[..., 12:], atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"head_dim 5 is too small .* 3 grid axes; .* >= 6"):
        apply_axial_rope(jnp.zeros((1, 1, 1, 5)), jnp.zeros((1, 1, 3), jnp.int32))


# ------------------------------------------------------------------ the ViT


def rope_vit(**overrides):
    config = dict(
        emb_features=24,
        num_layers=2,
        num_heads=2,  # head_dim 12: three sections of 4
        mlp_features=32,
        image_size=8,
        patch_size=4,
        num_frames=4,
        tubelet_size=2,
        position_embedding="rope",
    )
    return ViT(**{**config, **overrides})


def init(model, *inputs):
    params = nn.unbox(model.init(jax.random.key(0), *map(jnp.asarray, inputs)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(9), len(leaves))
    return jax.tree.unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )


_erf = np.vectorize(math.erf)


def np_layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_rope_vit(model, params, pixels, positions=None):
    """Tubelets (frame, row, column, channel), no position table, every block's
    queries and keys rotated by the tubelets' (time, row, column); images by (row, column)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    is_image = pixels.ndim == 4
    if is_image:
        pixels = pixels[:, None]
    b, f, h, w, _ = pixels.shape
    t, s = model.tubelet_size, model.patch_size
    grid = (f // t, h // s, w // s)
    patches, coords = [], []
    for i, j, k in np.ndindex(*grid):
        block = pixels[:, i * t : (i + 1) * t, j * s : (j + 1) * s, k * s : (k + 1) * s]
        patches.append(np.asarray(block, np.float64).reshape(b, -1))
        coords.append((i, j, k))
    patches, coords = np.stack(patches, 1), np.array(coords)[:, int(is_image) :]
    if positions is None:
        positions = np.broadcast_to(np.arange(len(coords)), (b, len(coords)))
    x = np.stack([patches[r, positions[r]] for r in range(b)])
    x = x @ p["patch_embed"]["kernel"] + p["patch_embed"]["bias"]
    c = coords[positions]  # [batch, K, 3]
    dim = model.emb_features // model.num_heads
    for layer in range(model.num_layers):
        L = jax.tree.map(lambda a, i=layer: a[i], p["layers"])
        a = L["attention"]
        y = np_layer_norm(x, L["attention_norm"], model.norm_eps)
        q, k, v = (
            np.einsum("bte,ehd->bthd", y, a[f"{n}_kernel"]) + a[f"{n}_bias"]
            for n in ("query", "key", "value")
        )
        q, k = np_axial_rope(q, c), np_axial_rope(k, c)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + np.einsum("bqhd,hde->bqe", o, a["out_kernel"]) + a["out_bias"]
        y = np_layer_norm(x, L["mlp_norm"], model.norm_eps)
        m = L["mlp"]
        up = y @ m["up"]["kernel"] + m["up"]["bias"]
        x = x + 0.5 * up * (1 + _erf(up / np.sqrt(2))) @ m["down"]["kernel"] + m["down"]["bias"]
    return np_layer_norm(x, p["final_norm"], model.norm_eps)


@pytest.fixture(scope="module")
def vit():
    model = rope_vit()
    return model, init(model, VIDEO)


def test_rope_vit_matches_numpy(vit):
    model, params = vit
    assert set(params) == {"patch_embed", "layers", "final_norm"}  # no position table
    got = model.apply({"params": params}, jnp.asarray(VIDEO))
    np.testing.assert_allclose(got, np_rope_vit(model, params, VIDEO), atol=TOLERANCE, rtol=0)


def test_a_subset_is_rotated_by_its_own_coordinates(vit):
    model, params = vit
    kept = np.array([[0, 5, 7, 3, 6], [4, 1, 6, 2, 7]], np.int32)  # of 2 x 2 x 2 tubelets
    got = model.apply({"params": params}, jnp.asarray(VIDEO), jnp.asarray(kept))
    want = np_rope_vit(model, params, VIDEO, kept)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    order = np.array([3, 0, 4, 2, 1])
    permuted = model.apply({"params": params}, jnp.asarray(VIDEO), jnp.asarray(kept[:, order]))
    np.testing.assert_allclose(permuted, np.asarray(got)[:, order], atol=1e-5, rtol=0)


def test_pipelined_rope_vit_equals_the_plain_stack(vit):
    """Coordinates [batch, K, 3] travel through two stages and two microbatches
    with different kept tubelets in every row."""
    model, params = vit
    video = jnp.asarray(np.concatenate([VIDEO, VIDEO[::-1]]))
    kept = jnp.asarray([[0, 4, 7, 2], [7, 1, 5, 3], [3, 2, 1, 0], [6, 5, 4, 2]], jnp.int32)
    piped = model.clone(num_stages=2, pipeline_microbatches=2)
    want = jax.jit(lambda p: model.apply({"params": p}, video, kept))(params)
    got = jax.jit(lambda p: piped.apply({"params": p}, video, kept))(params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_rope_on_images_is_two_dimensional():
    images = RNG.normal(size=(2, 8, 8, 3)).astype(np.float32)
    model = rope_vit(num_frames=None, tubelet_size=1)
    params = init(model, images)
    got = model.apply({"params": params}, jnp.asarray(images))
    # (row, column) over two sections of 6 features of head_dim 12
    np.testing.assert_allclose(got, np_rope_vit(model, params, images), atol=TOLERANCE, rtol=0)


def test_predictor_with_rope_follows_the_context_not_its_order():
    predictor = ViTPredictor(
        encoder_features=24,
        emb_features=12,
        num_layers=1,
        num_heads=2,
        mlp_features=16,
        image_size=8,
        patch_size=4,
        num_frames=4,
        tubelet_size=2,
        position_embedding="rope",
    )
    context = RNG.normal(size=(2, 4, 24)).astype(np.float32)
    context_positions = np.array([[0, 2, 4, 7], [5, 7, 1, 3]], np.int32)  # of 8 tubelets
    targets = np.array([[1, 3, 6], [0, 2, 6]], np.int32)
    params = init(predictor, context, context_positions, targets)
    assert "position_embed" not in params

    def predict(c, cp, tp=targets):
        return np.asarray(predictor.apply({"params": params}, *map(jnp.asarray, (c, cp, tp))))

    base = predict(context, context_positions)
    order = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(
        predict(context[:, order], context_positions[:, order]), base, atol=1e-5, rtol=0
    )
    # the same tokens at other positions predict something else
    assert np.abs(predict(context, (context_positions + 1) % 8) - base).max() > 1e-3


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match=r"head_dim >= 6; got head_dim 4 .*fewer heads"):
        rope_vit(num_heads=6).init(jax.random.key(0), jnp.asarray(VIDEO))
    with pytest.raises(ValueError, match=r"unknown position_embedding 'rope3d'.*'rope'"):
        rope_vit(position_embedding="rope3d").init(jax.random.key(0), jnp.asarray(VIDEO))
    x = jnp.zeros((1, 3, 8))
    coordinates = jnp.zeros((1, 3, 2), jnp.int32)
    valid = jnp.ones((1, 3), jnp.bool_)
    causal = Attention(num_heads=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"grid coordinates .* use masks.full\(\)"):
        causal.init(jax.random.key(0), x, coordinates, valid)
    full = Attention(num_heads=1, num_kv_heads=1, head_dim=8, mask=masks.full())
    with pytest.raises(ValueError, match=r"decode=True; .* decode with 1-D positions"):
        full.init(jax.random.key(0), x, coordinates, valid, decode=True)
