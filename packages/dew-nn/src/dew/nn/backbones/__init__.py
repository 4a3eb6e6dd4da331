"""Flax linen backbones whose parameters name logical axes (``dew.nn.axes``)."""

from dew.nn.backbones.causal import CausalTransformer, DecoderBlock
from dew.nn.backbones.dit import DiT, DiTBlock, DiTOptions
from dew.nn.backbones.transformer import Transformer
from dew.nn.backbones.video_dit import SpaceTimeBlock, VideoDiT
from dew.nn.backbones.vit import PatchGrid, ViT, ViTPredictor, sincos_table

__all__ = [
    "CausalTransformer",
    "DecoderBlock",
    "DiT",
    "DiTBlock",
    "DiTOptions",
    "PatchGrid",
    "SpaceTimeBlock",
    "Transformer",
    "VideoDiT",
    "ViT",
    "ViTPredictor",
    "sincos_table",
]
