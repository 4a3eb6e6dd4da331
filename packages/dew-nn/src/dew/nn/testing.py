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
