"""Tiny model configurations for tests, shared by every package's tests.

Each is a plain dict of keyword arguments, so a test spells its variant as an
override: ``tiny_lm(sliding_window=3)``, ``CausalTransformer(**{**TINY_LM,
"num_layers": 4})``. They are sized to compile in about a second on CPU and to
split over the emulated 8-device test mesh: widths, heads and vocabularies
divide by 2 and 4.

==================  ============================================================
``TINY_LM``         Llama-style decoder: RoPE, SwiGLU, RMSNorm, grouped-query
                    attention (4 query heads over 2 key/value heads)
``TINY_GPT2``       GPT-2-style decoder: learned positions, LayerNorm, GELU,
                    biases, tied embeddings
``TINY_MOE``        ``TINY_LM`` with a mixture of 4 experts, 2 per token
``TINY_ENCODER``    bidirectional :class:`dew.nn.backbones.transformer.Transformer`
                    over token ids (a masked-diffusion or MLM backbone)
``TINY_VIT``        :class:`dew.nn.ViT` over 12x12 RGB images in 4x4 patches (a 3x3 grid)
``TINY_PREDICTOR``  :class:`dew.nn.ViTPredictor` for ``TINY_VIT`` (JEPA)
``TINY_DIT``        :class:`dew.nn.DiT` over 8x8 RGB images in 2x2 patches (a 4x4
                    grid), unconditional; ``VideoDiT`` takes the same options
==================  ============================================================
"""

from __future__ import annotations

from typing import Any

from dew.nn.backbones.causal import CausalTransformer
from dew.nn.backbones.transformer import Transformer
from dew.nn.backbones.vit import ViT, ViTPredictor

TINY_LM: dict[str, Any] = dict(
    vocab_size=32,
    emb_features=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=24,
    max_seq_len=32,
)
"""A Llama-style :class:`dew.nn.CausalTransformer` (about 5k parameters)."""

TINY_GPT2: dict[str, Any] = dict(
    TINY_LM,
    num_kv_heads=None,
    position_embedding="learned",
    norm="layer",
    norm_eps=1e-5,
    mlp_activation="gelu",
    use_bias=True,
    tie_embeddings=True,
)
"""A GPT-2-style :class:`dew.nn.CausalTransformer`."""

TINY_MOE: dict[str, Any] = dict(TINY_LM, num_experts=4, experts_per_token=2)
"""``TINY_LM`` with a mixture-of-experts feed-forward block in every layer."""

TINY_ENCODER: dict[str, Any] = dict(
    vocab_size=32,
    emb_features=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=24,
    max_seq_len=32,
)
"""A bidirectional :class:`dew.nn.Transformer` over token ids (logits out)."""

TINY_VIT: dict[str, Any] = dict(
    emb_features=16,
    num_layers=2,
    num_heads=4,
    mlp_features=24,
    image_size=12,
    patch_size=4,
    num_channels=3,
)
"""A :class:`dew.nn.ViT` over ``[batch, 12, 12, 3]`` images: 9 patches of 48 values.
For video add ``num_frames`` and ``tubelet_size``."""

TINY_PREDICTOR: dict[str, Any] = dict(
    encoder_features=16,
    emb_features=8,
    num_layers=1,
    num_heads=2,
    mlp_features=16,
    image_size=12,
    patch_size=4,
    num_channels=3,
)
"""A :class:`dew.nn.ViTPredictor` from ``TINY_VIT``'s features (width 8)."""


TINY_DIT: dict[str, Any] = dict(
    sample_size=8,
    patch_size=2,
    in_channels=3,
    emb_features=16,
    num_layers=2,
    num_heads=2,
    mlp_features=24,
)
"""An unconditional :class:`dew.nn.DiT` over ``[batch, 8, 8, 3]`` images."""


def tiny_lm(**overrides: Any) -> CausalTransformer:
    """A :class:`dew.nn.CausalTransformer` of ``TINY_LM`` with ``overrides``."""
    return CausalTransformer(**{**TINY_LM, **overrides})


def tiny_moe(**overrides: Any) -> CausalTransformer:
    """A :class:`dew.nn.CausalTransformer` of ``TINY_MOE`` with ``overrides``."""
    return CausalTransformer(**{**TINY_MOE, **overrides})


def tiny_encoder(**overrides: Any) -> Transformer:
    """A :class:`dew.nn.Transformer` of ``TINY_ENCODER`` with ``overrides``."""
    return Transformer(**{**TINY_ENCODER, **overrides})


def tiny_vit(**overrides: Any) -> ViT:
    """A :class:`dew.nn.ViT` of ``TINY_VIT`` with ``overrides``."""
    return ViT(**{**TINY_VIT, **overrides})


def tiny_predictor(**overrides: Any) -> ViTPredictor:
    """A :class:`dew.nn.ViTPredictor` of ``TINY_PREDICTOR`` with ``overrides``."""
    return ViTPredictor(**{**TINY_PREDICTOR, **overrides})


# Every mask kind a fused attention kernel serves, as (name, Attention options, call
# options): compared against the XLA path by tests/test_fused_attention.py on the CPU
# (splash in Pallas interpret mode) and by tools/check_tpu_attention.py on a TPU.
def attention_kernel_cases(length: int = 256, block: int = 16) -> list[tuple[str, dict, dict]]:
    """``(name, attention options, call options)`` of each mask kind: causal, sliding
    window, full, full window, block-causal, padding with packed segments (causal and
    full), grouped-query heads, block diffusion's ``[noisy | clean]`` mask (every slot,
    and the noisy half querying alone), and fewer queries than keys. ``length`` slots
    (block diffusion: ``length // 2`` a half); call options may hold ``segments`` /
    ``valid`` as numpy arrays ``[2, length]``."""
    import numpy as np

    from dew.nn import masks

    half = length // 2
    segments = np.zeros((2, length), np.int32)
    segments[0, length // 3 :] = 1
    segments[1, length // 4 :] = 1
    segments[1, 3 * length // 4 :] = 2
    valid = np.ones((2, length), bool)
    valid[1, length - length // 8 :] = False  # right padding in row 1
    halves = masks.BlockDiffusionMask(half, block)
    bd_positions = np.concatenate([np.arange(half), np.arange(half)])
    return [
        ("causal", dict(mask=masks.causal()), {}),
        ("sliding_window", dict(mask=masks.sliding_window(block + 3)), {}),
        ("full", dict(mask=masks.full()), {}),
        ("full_window", dict(mask=masks.sliding_window(block + 3, causal=False)), {}),
        ("block_causal", dict(mask=masks.block_causal(block)), {}),
        ("causal_segments_padding", dict(mask=masks.causal()),
         dict(segments=segments, valid=valid)),
        ("full_segments_padding", dict(mask=masks.full()), dict(segments=segments, valid=valid)),
        ("gqa_causal", dict(mask=masks.causal(), num_kv_heads=1), {}),
        ("block_diffusion", dict(mask=masks.full()),
         dict(query_key_mask=halves, positions=bd_positions)),
        ("block_diffusion_noisy_half", dict(mask=masks.full()),
         dict(query_key_mask=halves, positions=bd_positions, query_length=half)),
        ("causal_fewer_queries", dict(mask=masks.causal()), dict(query_length=length // 2)),
    ]  # fmt: skip


def compare_attention_kernels(
    attention: dict, call: dict, *, kernel: str, length: int = 256, dtype=None, seed: int = 0
) -> dict[str, float]:
    """Max |difference| between :class:`dew.nn.Attention` with ``kernel`` and with
    ``'xla'``, on rows that are not padding: the output, and the gradients of a
    weighted sum of it with respect to the input and every parameter (relative to
    the largest gradient of each). Returns ``{'output', 'input_grad', 'param_grad'}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dew.nn.attention import Attention

    dtype = dtype or jnp.float32
    options = dict(num_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype) | attention
    batch, embed = 2, 64
    k_x, k_w, k_init = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k_x, (batch, length, embed), jnp.float32)
    positions = call.get("positions", np.arange(length))
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, length))
    valid = call.get("valid", np.ones((batch, length), bool))
    segments = call.get("segments")
    queries = call.get("query_length") or length
    weights = jax.random.normal(k_w, (batch, queries, embed)) * valid[:, :queries, None]

    def run(kernel_name):
        module = Attention(**options, kernel=kernel_name)
        kwargs = dict(
            segment_ids=None if segments is None else jnp.asarray(segments),
            query_key_mask=call.get("query_key_mask"),
            query_length=call.get("query_length"),
        )
        params = module.init(k_init, x, positions, jnp.asarray(valid), **kwargs)

        def loss(params, x):
            y = module.apply(params, x.astype(dtype), positions, jnp.asarray(valid), **kwargs)
            return jnp.sum(y.astype(jnp.float32) * weights), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return y, grads

    y_ref, (gp_ref, gx_ref) = run("xla")
    y, (gp, gx) = run(kernel)
    rows = valid[:, :queries, None]
    relative = lambda a, b: float(  # noqa: E731
        np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))
        / (np.max(np.abs(np.asarray(b, np.float32))) + 1e-30)
    )
    return dict(
        output=float(np.max(np.abs(np.asarray((y - y_ref) * rows, np.float32)))),
        input_grad=relative(gx * valid[..., None], gx_ref * valid[..., None]),
        param_grad=max(
            relative(a, b)
            for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gp_ref), strict=True)
        ),
    )
