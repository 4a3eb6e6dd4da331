"""Flax linen backbones whose parameters name logical axes (``dew.nn.axes``)."""

from dew.nn.backbones._options import (
    BackboneOptions,
    BlockConfig,
    BlockOptions,
    PreNormOptions,
    StackOptions,
    TransformerOptions,
    layer_stack_of,
)
from dew.nn.backbones.block import DecoderBlock, DiTBlock
from dew.nn.backbones.causal import CausalTransformer
from dew.nn.backbones.dit import DiT, DiTOptions
from dew.nn.backbones.transformer import Transformer
from dew.nn.backbones.video_dit import SpaceTimeBlock, VideoDiT
from dew.nn.backbones.vit import (
    PatchGrid,
    PatchOptions,
    ViT,
    ViTClassifier,
    ViTPredictor,
    scale_pixels,
    sincos_table,
)

__all__ = [
    "BackboneOptions",
    "BlockConfig",
    "BlockOptions",
    "CausalTransformer",
    "DecoderBlock",
    "DiT",
    "DiTBlock",
    "DiTOptions",
    "PatchGrid",
    "PatchOptions",
    "PreNormOptions",
    "SpaceTimeBlock",
    "StackOptions",
    "Transformer",
    "TransformerOptions",
    "VideoDiT",
    "ViT",
    "ViTClassifier",
    "ViTPredictor",
    "layer_stack_of",
    "scale_pixels",
    "sincos_table",
]
