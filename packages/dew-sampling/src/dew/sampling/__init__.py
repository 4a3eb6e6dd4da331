"""dew.sampling: generation with a KV cache, beam search, inference pipelines and
pretrained checkpoints (Hugging Face and Dew formats)."""

from dew.sampling.beam import beam_decode, beam_search
from dew.sampling.decoding import Generation, init_cache
from dew.sampling.features import FeatureExtractor
from dew.sampling.generate import decode, generate
from dew.sampling.pipelines import TextGeneration
from dew.sampling.pretrained import Pretrained
from dew.sampling.prompts import pad_prompts
from dew.sampling.sampling import Sampling, filter_logits, sample_logits

__version__ = "0.1.0"

__all__ = [
    "FeatureExtractor",
    "Generation",
    "Pretrained",
    "Sampling",
    "TextGeneration",
    "beam_decode",
    "beam_search",
    "decode",
    "filter_logits",
    "generate",
    "init_cache",
    "pad_prompts",
    "sample_logits",
]
