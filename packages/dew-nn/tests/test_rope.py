"""Rotary embeddings against a numpy implementation of the same formulas."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn.rope import RopeScaling, apply_rope, inverse_frequencies


def numpy_rope(x, positions, inv_freq):
    # pairs (i, i + d/2) rotated by angle p * inv_freq[i]
    d = x.shape[-1] // 2
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            ang = positions[b, t] * inv_freq
            c, s = np.cos(ang), np.sin(ang)
            a, bb = x[b, t, :, :d], x[b, t, :, d:]
            out[b, t, :, :d] = a * c - bb * s
            out[b, t, :, d:] = bb * c + a * s
    return out


def test_apply_rope_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    inv_freq = inverse_frequencies(8, 10000.0, None)
    got = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq)
    np.testing.assert_allclose(got, numpy_rope(x, positions, inv_freq), rtol=1e-5, atol=1e-5)


def test_rotation_preserves_relative_position_dot_products():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(2, 1, 1, 1, 16)).astype(np.float32)
    inv_freq = inverse_frequencies(16, 10000.0, None)

    def dot(pq, pk):
        a = apply_rope(jnp.asarray(q), jnp.array([[pq]]), inv_freq)
        b = apply_rope(jnp.asarray(k), jnp.array([[pk]]), inv_freq)
        return float(jnp.sum(a * b))

    assert dot(5, 2) == pytest.approx(dot(13, 10), rel=1e-5)


def test_linear_scaling_divides_frequencies():
    base = inverse_frequencies(8, 500.0, None)
    np.testing.assert_allclose(
        inverse_frequencies(8, 500.0, RopeScaling(kind="linear", factor=4.0)), base / 4
    )


def test_llama3_scaling_matches_the_reference_formula():
    # Meta's reference (llama-models, apply_scaling), written out independently.
    dim, theta = 64, 500000.0
    scale, low, high, old = 8.0, 1.0, 4.0, 8192
    freqs = [1.0 / (theta ** (i / dim)) for i in range(0, dim, 2)]
    expected = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            expected.append(f)
        elif wavelen > old / low:
            expected.append(f / scale)
        else:
            smooth = (old / wavelen - low) / (high - low)
            expected.append((1 - smooth) * f / scale + smooth * f)
    got = inverse_frequencies(
        dim,
        theta,
        RopeScaling(
            kind="llama3",
            factor=scale,
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position=old,
        ),
    )
    np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_unknown_scaling_is_refused():
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        RopeScaling(kind="yarn", factor=2.0)
