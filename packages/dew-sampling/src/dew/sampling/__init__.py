"""dew.sampling: generation with a KV cache, beam search, diffusion samplers (images,
video, and tokens: masked and block diffusion), inference pipelines and pretrained
checkpoints (Hugging Face and Dew formats)."""

from dew.nn.allocator import configure_allocator
from dew.sampling.beam import beam_decode, beam_search
from dew.sampling.decoding import Generation, init_cache
from dew.sampling.diffusion_pipelines import (
    ClassToImage,
    ClassToVideo,
    TextToImage,
    TextToVideo,
    sample_grid,
)
from dew.sampling.diffusion_samplers import (
    DDIM,
    DDPM,
    Denoised,
    EDMHeun,
    FlowEuler,
    FlowHeun,
    make_sampler,
    model_denoiser,
    sample_diffusion,
)
from dew.sampling.diffusion_targets import TARGETS, predictions_of, target_of
from dew.sampling.features import FeatureExtractor
from dew.sampling.flow_sde import FlowSDE, Trajectory, sample_flow_sde
from dew.sampling.generate import decode, generate
from dew.sampling.noise_schedules import DDPMSchedule, EDMSchedule, FlowSchedule
from dew.sampling.pipelines import TextGeneration
from dew.sampling.pretrained import Pretrained
from dew.sampling.prompts import pad_prompts
from dew.sampling.sampling import Sampling, filter_logits, sample_logits
from dew.sampling.text_encoders import TextEncoder
from dew.sampling.token_diffusion import (
    MaskedSampler,
    MaskSchedule,
    TokenDiffusionGeneration,
    sample_blocks,
    sample_categorical,
    sample_entropy,
    sample_masked,
    subs_log_probs,
)

# glibc malloc tuned for XLA's large buffers before any is allocated
# (dew.nn.allocator; DEW_ALLOCATOR=system opts out)
configure_allocator()

__version__ = "0.1.0"

__all__ = [
    "ClassToImage",
    "ClassToVideo",
    "TextEncoder",
    "TextToImage",
    "TextToVideo",
    "sample_grid",
    "DDIM",
    "DDPM",
    "DDPMSchedule",
    "Denoised",
    "EDMHeun",
    "EDMSchedule",
    "FlowEuler",
    "FlowHeun",
    "FlowSchedule",
    "FlowSDE",
    "Trajectory",
    "TARGETS",
    "FeatureExtractor",
    "Generation",
    "MaskSchedule",
    "MaskedSampler",
    "TokenDiffusionGeneration",
    "Pretrained",
    "Sampling",
    "TextGeneration",
    "beam_decode",
    "beam_search",
    "decode",
    "filter_logits",
    "generate",
    "init_cache",
    "make_sampler",
    "model_denoiser",
    "pad_prompts",
    "predictions_of",
    "sample_blocks",
    "sample_categorical",
    "sample_diffusion",
    "sample_flow_sde",
    "sample_entropy",
    "sample_masked",
    "sample_logits",
    "subs_log_probs",
    "target_of",
]
