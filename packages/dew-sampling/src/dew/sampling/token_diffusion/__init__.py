"""Diffusion over tokens (masked diffusion, MDLM, and block diffusion, BD3-LM): the
masking process and its schedule, SUBS, the samplers (:mod:`.samplers`) and the
text-generation task with its checkpoint (:mod:`.generation`)."""

from dew.sampling.token_diffusion.generation import TokenDiffusionGeneration, is_token_diffusion
from dew.sampling.token_diffusion.samplers import (
    NEG_INF,
    SCHEDULES,
    MaskedSampler,
    MaskSchedule,
    check_prompt_fits,
    sample_blocks,
    sample_categorical,
    sample_entropy,
    sample_masked,
    subs_log_probs,
    subs_nll,
)

__all__ = [
    "NEG_INF",
    "SCHEDULES",
    "MaskSchedule",
    "MaskedSampler",
    "TokenDiffusionGeneration",
    "check_prompt_fits",
    "is_token_diffusion",
    "sample_blocks",
    "sample_categorical",
    "sample_entropy",
    "sample_masked",
    "subs_log_probs",
    "subs_nll",
]
