"""dew.sampling: inference, organised by what it serves:

- :mod:`dew.sampling.causal`: causal decoding (generation with a KV cache, beam search,
  sampling rules, the text-generation task);
- :mod:`dew.sampling.diffusion`: continuous diffusion (schedules, samplers, the flow SDE,
  text encoders, the image and video tasks);
- :mod:`dew.sampling.token_diffusion`: diffusion over tokens (masked and block diffusion:
  samplers and the text-generation task);
- :mod:`dew.sampling.checkpoint_io`: checkpoint I/O (:class:`Pretrained`, Hugging Face and
  Dew formats, safetensors);
- :mod:`dew.sampling.features`: features of a trained encoder.

Every public name is re-exported here (``from dew.sampling import generate``)."""

import importlib
import sys

from dew.nn.allocator import configure_allocator
from dew.sampling.causal import (
    Generation,
    Sampling,
    TextGeneration,
    beam_decode,
    beam_search,
    decode,
    filter_logits,
    generate,
    init_cache,
    pad_prompts,
    sample_logits,
)
from dew.sampling.checkpoint_io import Pretrained
from dew.sampling.diffusion import (
    DDIM,
    DDPM,
    TARGETS,
    ClassToImage,
    ClassToVideo,
    DDPMSchedule,
    Denoised,
    EDMHeun,
    EDMSchedule,
    FlowEuler,
    FlowHeun,
    FlowSchedule,
    FlowSDE,
    TextEncoder,
    TextToImage,
    TextToVideo,
    Trajectory,
    make_sampler,
    model_denoiser,
    predictions_of,
    sample_diffusion,
    sample_flow_sde,
    sample_grid,
    target_of,
)
from dew.sampling.features import FeatureExtractor
from dew.sampling.token_diffusion import (
    MaskedSampler,
    MaskSchedule,
    TokenDiffusionGeneration,
    sample_blocks,
    sample_categorical,
    sample_entropy,
    sample_masked,
    subs_log_probs,
    subs_nll,
)

# The modules' former flat paths (dew.sampling.generate, .noise_schedules, .pretrained,
# ...) name the same module objects, so imports written against them keep working.
# No file stays behind at an old path: git follows each move as a rename.
MOVED = {
    "beam": "causal.beam",
    "decoding": "causal.decoding",
    "generate": "causal.generate",
    "sampling": "causal.sampling",
    "prompts": "causal.prompts",
    "pipelines": "causal.text_generation",
    "noise_schedules": "diffusion.schedules",
    "diffusion_targets": "diffusion.targets",
    "diffusion_samplers": "diffusion.samplers",
    "flow_sde": "diffusion.flow_sde",
    "diffusion_pipelines": "diffusion.pipelines",
    "text_encoders": "diffusion.text_encoders",
    "checkpoint_files": "checkpoint_io.files",
    "checkpoint_formats": "checkpoint_io.formats",
    "byte_level": "checkpoint_io.byte_level",
    "pretrained": "checkpoint_io.pretrained",
}
"""Former module path (under ``dew.sampling``) -> where the module lives now."""

for _old, _new in MOVED.items():
    _module = importlib.import_module(f"{__name__}.{_new}")
    sys.modules[f"{__name__}.{_old}"] = _module
    if _old not in globals():  # a public name (generate) keeps its object
        globals()[_old] = _module
del _old, _new, _module

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
    "subs_nll",
    "target_of",
]
