"""dew.nn: Flax modules whose parameters name logical axes, and the model registry."""

from dew.nn import axes, backbones, masks, models, stack, token_scores
from dew.nn.attention import Attention
from dew.nn.backbones import CausalTransformer, DiT, VideoDiT
from dew.nn.backbones.transformer import Transformer
from dew.nn.backbones.vit import ViT, ViTClassifier, ViTPredictor
from dew.nn.lora import LoRA
from dew.nn.masks import MaskPolicy
from dew.nn.mlp import MLP
from dew.nn.moe import MoE
from dew.nn.norms import LayerNorm, RMSNorm
from dew.nn.rope import RopeScaling
from dew.nn.stack import LayerStack
from dew.nn.token_scores import TokenScores
from dew.nn.value import Critic, ValueHead

__version__ = "0.1.0"

__all__ = [
    "MLP",
    "Attention",
    "CausalTransformer",
    "Critic",
    "DiT",
    "LayerNorm",
    "LayerStack",
    "LoRA",
    "MaskPolicy",
    "MoE",
    "RMSNorm",
    "RopeScaling",
    "TokenScores",
    "Transformer",
    "VideoDiT",
    "ViT",
    "ViTClassifier",
    "ValueHead",
    "ViTPredictor",
    "axes",
    "backbones",
    "masks",
    "models",
    "stack",
    "token_scores",
]
