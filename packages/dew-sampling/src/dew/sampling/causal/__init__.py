"""Causal decoding: autoregressive generation with a KV cache (:mod:`.generate`), beam
search (:mod:`.beam`), the cached model calls both share (:mod:`.decoding`), token
sampling rules (:mod:`.sampling`), prompt padding and end ids (:mod:`.prompts`) and the
strings-in, strings-out task (:mod:`.text_generation`)."""

from dew.sampling.causal.beam import beam_decode, beam_search
from dew.sampling.causal.decoding import Generation, init_cache
from dew.sampling.causal.generate import decode, generate
from dew.sampling.causal.prompts import end_id_tuple, pad_prompts
from dew.sampling.causal.sampling import Sampling, filter_logits, sample_logits
from dew.sampling.causal.text_generation import TextGeneration

__all__ = [
    "Generation",
    "Sampling",
    "TextGeneration",
    "beam_decode",
    "beam_search",
    "decode",
    "end_id_tuple",
    "filter_logits",
    "generate",
    "init_cache",
    "pad_prompts",
    "sample_logits",
]
