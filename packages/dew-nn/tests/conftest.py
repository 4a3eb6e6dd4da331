"""A numpy transformer and numpy attention masks: the independent references
the dew-nn backbone tests check against (``reference`` fixture)."""

import types

import jax
import numpy as np
import pytest

from dew.nn.rope import inverse_frequencies


def np_allowed(kind, query_positions, key_positions, window=None, block_size=None):
    """Boolean ``[batch, query, key]``, one pair at a time, from the definitions:
    causal ``k <= q``; full: all; block_causal ``k // b <= q // b``; a window
    ``|q - k| < w``."""
    qp, kp = np.asarray(query_positions), np.asarray(key_positions)
    out = np.zeros((qp.shape[0], qp.shape[1], kp.shape[1]), bool)
    for b, i, j in np.ndindex(*out.shape):
        q, k = int(qp[b, i]), int(kp[b, j])
        ok = {
            "causal": k <= q,
            "full": True,
            "block_causal": block_size is not None and k // block_size <= q // block_size,
        }[kind]
        out[b, i, j] = ok and (window is None or abs(q - k) < window)
    return out


def np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * scale


def np_layer(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def np_rope(x, pos, inv_freq):
    ang = pos[..., None] * inv_freq  # [b, t, d/2]
    c, s = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    a, b = np.split(x, 2, -1)
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def np_forward(model, params, inputs, allowed=None, positions=None):
    """A :class:`CausalTransformer` or :class:`Transformer` in numpy.

    allowed: boolean ``[batch, query, key]``, which keys each query sees
      (default causal); a row with none sees its own position.
    """
    p = jax.tree.map(np.asarray, params)
    inputs = np.asarray(inputs)
    b, t = inputs.shape[:2]
    if getattr(model, "vocab_size", None) is not None:
        x = p["embed"]["embedding"][inputs]
    else:
        x = inputs @ p["input_projection"]["kernel"]
        if model.use_bias:
            x = x + p["input_projection"]["bias"]
    pos = np.broadcast_to(np.arange(t), (b, t)) if positions is None else np.asarray(positions)
    if model.position_embedding == "learned":
        x = x + p["position_embed"][pos]
    if allowed is None:
        allowed = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    allowed = allowed | (np.eye(t, dtype=bool) & ~allowed.any(-1, keepdims=True))
    h_q, h_kv = model.num_heads, model.kv_heads
    hd = model.emb_features // h_q
    inv = inverse_frequencies(hd, model.rope_theta, None)
    norm = (
        (lambda x, q: np_rms(x, q["scale"], model.norm_eps))
        if model.norm == "rms"
        else (lambda x, q: np_layer(x, q["scale"], q["bias"], model.norm_eps))
    )
    for i in range(model.num_layers):
        L = jax.tree.map(lambda a, i=i: a[i], p["layers"])
        a = L["attention"]
        h = norm(x, L["attention_norm"])
        q = np.einsum("bte,ehd->bthd", h, a["query_kernel"])
        k = np.einsum("bte,ehd->bthd", h, a["key_kernel"])
        v = np.einsum("bte,ehd->bthd", h, a["value_kernel"])
        if model.use_qkv_bias or model.use_bias:
            q, k, v = q + a["query_bias"], k + a["key_bias"], v + a["value_bias"]
        if model.position_embedding == "rope":
            q, k = np_rope(q, pos, inv), np_rope(k, pos, inv)
        k = np.repeat(k, h_q // h_kv, axis=2)
        v = np.repeat(v, h_q // h_kv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(allowed[:, None], scores, -1e30)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", w, v)
        o = np.einsum("bqhd,hde->bqe", o, a["out_kernel"])
        if model.use_bias:
            o = o + a["out_bias"]
        x = x + o
        h = norm(x, L["mlp_norm"])
        m = L["mlp"]
        bias = (lambda n, m=m: m[n]["bias"]) if model.use_bias else (lambda n: 0.0)
        up = h @ m["up"]["kernel"] + bias("up")
        if model.mlp_activation == "swiglu":
            g = h @ m["gate"]["kernel"] + bias("gate")
            hidden = g / (1 + np.exp(-g)) * up
        else:  # tanh-approximated gelu
            hidden = 0.5 * up * (1 + np.tanh(np.sqrt(2 / np.pi) * (up + 0.044715 * up**3)))
        x = x + hidden @ m["down"]["kernel"] + bias("down")
    x = norm(x, p["final_norm"])
    if "head" in p:  # Transformer
        return x @ p["head"]["kernel"] + (p["head"]["bias"] if model.use_bias else 0.0)
    if "lm_head" in p:
        return x @ p["lm_head"]["kernel"]
    if getattr(model, "tie_embeddings", False):
        return x @ p["embed"]["embedding"].T
    return x


@pytest.fixture(scope="session")
def reference():
    """``reference.forward(model, params, inputs, allowed=None, positions=None)``
    and ``reference.allowed(kind, query_positions, key_positions, window, block_size)``."""
    return types.SimpleNamespace(forward=np_forward, allowed=np_allowed)
