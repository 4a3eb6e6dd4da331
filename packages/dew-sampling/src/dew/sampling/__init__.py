"""dew.sampling: generation with a KV cache, inference pipelines, pretrained checkpoints."""

from dew.sampling.generate import Generation, decode, generate, init_cache, pad_prompts
from dew.sampling.pipelines import TextGeneration
from dew.sampling.sampling import Sampling, filter_logits, sample_logits

__version__ = "0.1.0"

__all__ = [
    "Generation",
    "Sampling",
    "TextGeneration",
    "decode",
    "filter_logits",
    "generate",
    "init_cache",
    "pad_prompts",
    "sample_logits",
]
