"""Flax linen backbones whose parameters name logical axes (``dew.nn.axes``)."""

from dew.nn.backbones.causal import CausalTransformer, DecoderBlock

__all__ = ["CausalTransformer", "DecoderBlock"]
