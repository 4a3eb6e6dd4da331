"""Continuous diffusion (images, video): noise schedules (:mod:`.schedules`), prediction
targets (:mod:`.targets`), samplers (:mod:`.samplers`; the flow SDE with per-step
log-probs, :mod:`.flow_sde`), text encoders for conditioning (:mod:`.text_encoders`)
and the class- and text-to-image / video tasks (:mod:`.pipelines`)."""

from dew.sampling.diffusion.flow_sde import FlowSDE, Trajectory, sample_flow_sde
from dew.sampling.diffusion.pipelines import (
    ClassToImage,
    ClassToVideo,
    TextToImage,
    TextToVideo,
    sample_grid,
)
from dew.sampling.diffusion.samplers import (
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
from dew.sampling.diffusion.schedules import DDPMSchedule, EDMSchedule, FlowSchedule, per_row
from dew.sampling.diffusion.targets import TARGETS, predictions_of, target_of
from dew.sampling.diffusion.text_encoders import TextEncoder

__all__ = [
    "DDIM",
    "DDPM",
    "DDPMSchedule",
    "ClassToImage",
    "ClassToVideo",
    "Denoised",
    "EDMHeun",
    "EDMSchedule",
    "FlowEuler",
    "FlowHeun",
    "FlowSDE",
    "FlowSchedule",
    "TARGETS",
    "TextEncoder",
    "TextToImage",
    "TextToVideo",
    "Trajectory",
    "make_sampler",
    "model_denoiser",
    "per_row",
    "predictions_of",
    "sample_diffusion",
    "sample_flow_sde",
    "sample_grid",
    "target_of",
]
