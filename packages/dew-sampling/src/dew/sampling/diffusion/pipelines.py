"""Diffusion pipelines: labels or prompts in, ``uint8`` images or videos out.

- :class:`ClassToImage` / :class:`ClassToVideo`: class labels (a ``DiT`` /
  ``VideoDiT`` with ``num_classes``; an unconditional model takes a count);
- :class:`TextToImage` / :class:`TextToVideo`: prompts, encoded by a
  :class:`dew.sampling.TextEncoder` into the context the model cross-attends to.

Each holds the denoiser (its EMA weights when the objective kept them), how it
was trained (a schedule of :mod:`dew.sampling.diffusion.schedules` and a prediction
target) and sampling defaults; a call draws ``x_T`` from ``seed`` and runs one
compiled sampler of :mod:`dew.sampling.diffusion.samplers` (DDPM, DDIM, flow
Euler / Heun, EDM Heun) with classifier-free guidance
``x0 = x0_u + w (x0_c - x0_u)`` (Ho & Salimans 2022). Samples in ``[-1, 1]``
become pixels ``round((x + 1) * 127.5)`` clipped to ``0..255``.

``save(dir)`` writes a Dew checkpoint (``dew_config.json`` with a
``"diffusion"`` section, ``model.safetensors``, and the text encoder's own
checkpoint in ``text_encoder/``); :meth:`dew.sampling.Pretrained.load` reads it
back and ``.pipeline()`` rebuilds the pipeline::

    "diffusion": {"task": "class_to_image" | "class_to_video" | "text_to_image" |
                          "text_to_video",
                  "schedule": {"family": "ddpm" | "flow" | "edm", <its fields>},
                  "target": "eps" | "v" | "x0" | "flow",
                  "sample_shape": [H, W, C] or [F, H, W, C],
                  "sampler": {"name": "ddim", <its fields but num_steps>} | null,
                  "num_steps": null | int, "guidance": float,
                  "has_null_condition": bool, "clip_denoised": null | float,
                  "text_encoder": null | {"directory": "text_encoder", "max_length": int,
                                          "null_context": absent | "null_context"}}
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import is_whole_number, real_number
from dew.sampling.checkpoint_io import formats as checkpoint_formats
from dew.sampling.checkpoint_io.files import TensorReader, write_tensors
from dew.sampling.diffusion.samplers import (
    SAMPLERS,
    check_target_for,
    make_sampler,
    model_denoiser,
    sample_diffusion,
)
from dew.sampling.diffusion.schedules import DDPMSchedule, EDMSchedule, FlowSchedule
from dew.sampling.diffusion.text_encoders import TextEncoder

SCHEDULES = {"ddpm": DDPMSchedule, "flow": FlowSchedule, "edm": EDMSchedule}
TEXT_ENCODER_DIRECTORY = "text_encoder"
NULL_CONTEXT_DIRECTORY = "null_context"


def to_pixels(x: jax.Array) -> np.ndarray:
    """Samples in ``[-1, 1]`` as uint8 pixels ``round((x + 1) * 127.5)``, clipped."""
    x = np.asarray(jax.device_get(x), np.float32)
    return np.clip(np.round((x + 1.0) * 127.5), 0, 255).astype(np.uint8)


def sample_grid(samples: np.ndarray, columns: int | None = None) -> np.ndarray:
    """Samples ``[n, H, W, C]`` (or videos ``[n, F, H, W, C]``) tiled into one image
    ``[rows * H, columns * W, C]`` (or video ``[F, rows * H, columns * W, C]``), row by
    row, empty cells black; columns None = ``ceil(sqrt(n))``."""
    samples = np.asarray(samples)
    count = samples.shape[0]
    columns = columns or math.ceil(math.sqrt(count))
    rows = -(-count // columns)
    cells = np.zeros((rows * columns, *samples.shape[1:]), samples.dtype)
    cells[:count] = samples
    *lead, height, width, channels = samples.shape[1:]
    grid = cells.reshape(rows, columns, *lead, height, width, channels)
    if lead:  # [rows, columns, F, H, W, C] -> [F, rows, H, columns, W, C]
        grid = grid.transpose(2, 0, 3, 1, 4, 5)
        return grid.reshape(lead[0], rows * height, columns * width, channels)
    return grid.transpose(0, 2, 1, 3, 4).reshape(rows * height, columns * width, channels)


def schedule_to_json(schedule) -> dict[str, Any]:
    return {"family": schedule.family, **dataclasses.asdict(schedule)}


def schedule_from_json(config: dict[str, Any]):
    config = dict(config)
    family = config.pop("family", None)
    if family not in SCHEDULES:
        raise ValueError(f"unknown schedule family {family!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[family](**config)


def _sampler_to_json(sampler) -> dict[str, Any] | None:
    if sampler is None:
        return None
    if isinstance(sampler, str):
        return {"name": sampler}
    (name,) = [k for k, v in SAMPLERS.items() if isinstance(sampler, v)]
    options = {k: v for k, v in dataclasses.asdict(sampler).items() if k != "num_steps"}
    return {"name": name, **{k: v for k, v in options.items() if v is not None}}


def _sampler_from_json(config: dict[str, Any] | None):
    if config is None:
        return None
    config = dict(config)
    name = config.pop("name")
    return name if not config else SAMPLERS[name](**config)


@functools.lru_cache(maxsize=32)
def _compiled_sampling(model, schedule, target, sampler, guidance, clip, null_label, shape):
    """One compiled sampler per (model, training, sampler, guidance, shape)."""
    learn_sigma = bool(getattr(model, "learn_sigma", False))

    def run(params, label, context, null_context, key):
        denoise = model_denoiser(
            functools.partial(model.apply, {"params": params}),
            schedule=schedule,
            target=target,
            learn_sigma=learn_sigma,
            label=label,
            null_label=null_label,
            context=context,
            null_context=null_context,
            guidance=guidance,
            clip_denoised=clip,
        )
        return sample_diffusion(denoise, schedule=schedule, sampler=sampler, key=key, shape=shape)

    return jax.jit(run)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Diffusion:
    """The fields every diffusion pipeline shares.

    model: the denoiser (``dew.nn.DiT``, ``dew.nn.VideoDiT``, or any registered module
      ``apply(params, x, t, label=, context=)``).
    params: its parameters (the EMA weights when training kept them).
    schedule: the noise schedule it was trained with (``DDPMSchedule``,
      ``FlowSchedule``, ``EDMSchedule``).
    target: what it predicts: ``'eps'``, ``'v'``, ``'x0'`` or ``'flow'``.
    sample_shape: one sample's shape, ``(H, W, C)`` or ``(F, H, W, C)``.
    sampler: default sampler: a name (``'ddpm'``, ``'ddim'``, ``'euler'``, ``'heun'``,
      ``'edm_heun'``), a sampler config (``DDIM(eta=0.5)``), or None = the schedule's
      default (DDIM, flow Euler, EDM Heun).
    num_steps: default sampling steps; None = the sampler's default.
    guidance: default classifier-free guidance scale; 1.0 = none.
    has_null_condition: the model was trained with condition dropout, so it knows
      the null condition (label ``num_classes``, the empty prompt) that guidance needs.
    clip_denoised: clip each ``x0`` estimate to ``[-c, c]`` (1.0 for pixels, as
      improved-diffusion); None = no clip.
    checkpoint_format: what :meth:`save` writes: ``'dew'`` (the whole pipeline) or the
      Hugging Face / diffusers family the denoiser came from (the model alone).
    hf_config: the ``config.json`` of that checkpoint.
    """

    model: Any
    params: Any
    schedule: Any
    target: str
    sample_shape: tuple[int, ...]
    sampler: Any = None
    num_steps: int | None = None
    guidance: float = 1.0
    has_null_condition: bool = True
    clip_denoised: float | None = 1.0
    checkpoint_format: str = "dew"
    hf_config: dict | None = None

    task = ""
    sample_rank = 3

    def __post_init__(self):
        object.__setattr__(self, "params", nn.meta.unbox(self.params))
        object.__setattr__(self, "sample_shape", tuple(int(d) for d in self.sample_shape))
        if len(self.sample_shape) != self.sample_rank:
            kind = "[H, W, C]" if self.sample_rank == 3 else "[F, H, W, C]"
            raise ValueError(
                f"{type(self).__name__} sample_shape {self.sample_shape} must be {kind}"
            )
        check_target_for(self.schedule, self.target)
        make_sampler(self.sampler, schedule=self.schedule, num_steps=self.num_steps)
        self._check_guidance(self.guidance)

    def _check_guidance(self, guidance) -> float:
        guidance = real_number(guidance, "guidance", low=0.0, meaning="a scale; 1.0 = none")
        if guidance != 1.0 and not self.has_null_condition:
            raise ValueError(
                f"guidance {guidance} needs the null condition, which this model never saw: "
                f"it was trained without condition dropout; use guidance=1.0, or train with "
                f"condition dropout (DiffusionObjective(condition_dropout=0.1))"
            )
        return float(guidance)

    def _run(self, count, *, label, context, null_context, num_steps, guidance, seed, sampler):
        guidance = self._check_guidance(self.guidance if guidance is None else guidance)
        steps = self.num_steps if num_steps is None else num_steps
        sampler = make_sampler(
            self.sampler if sampler is None else sampler, schedule=self.schedule, num_steps=steps
        )
        if not is_whole_number(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        null_label = getattr(self.model, "num_classes", 0) or None
        run = _compiled_sampling(
            self.model,
            self.schedule,
            self.target,
            sampler,
            guidance,
            self.clip_denoised,
            null_label,
            (count, *self.sample_shape),
        )
        x = run(self.params, label, context, null_context, jax.random.key(int(seed)))
        return to_pixels(x)

    def _description(self, text_encoder: dict | None) -> dict[str, Any]:
        return {
            "task": self.task,
            "schedule": schedule_to_json(self.schedule),
            "target": self.target,
            "sample_shape": list(self.sample_shape),
            "sampler": _sampler_to_json(self.sampler),
            "num_steps": self.num_steps,
            "guidance": self.guidance,
            "has_null_condition": self.has_null_condition,
            "clip_denoised": self.clip_denoised,
            "text_encoder": text_encoder,
        }

    def _write(self, path, format, text_encoder: dict | None) -> pathlib.Path:
        format = format or self.checkpoint_format
        return checkpoint_formats.write(
            pathlib.Path(path),
            model=self.model,
            params=self.params,
            tokenizer=None,
            format=format,
            end_ids=(),
            hf_config=self.hf_config if format == self.checkpoint_format else None,
            diffusion=self._description(text_encoder) if format == "dew" else None,
        )


def _labels(labels, num_classes: int) -> np.ndarray:
    array = np.asarray([labels] if np.ndim(labels) == 0 else labels)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be one int or a non-empty list of ints, got {labels!r}")
    bad = array[(array < 0) | (array >= num_classes)]
    if bad.size:
        raise ValueError(
            f"label {int(bad[0])} is outside the model's classes 0..{num_classes - 1} "
            f"(num_classes={num_classes}); ask for a class the model was trained on"
        )
    return array.astype(np.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassToImage(_Diffusion):
    """Class labels in, uint8 images ``[batch, H, W, C]`` out (fields: the module's
    shared ones). An unconditional model (``num_classes=0``) takes ``count=``."""

    task = "class_to_image"

    def __call__(
        self,
        labels=None,
        *,
        count: int | None = None,
        num_steps: int | None = None,
        guidance: float | None = None,
        seed: int = 0,
        sampler: Any = None,
    ) -> np.ndarray:
        """Sample one image per label (``labels``: an int or a list of ints in
        ``0..num_classes-1``), or ``count`` unconditional images.

        num_steps, guidance, sampler: None = the pipeline's defaults.
        seed: the initial noise and every step's noise are drawn from ``key(seed)``.
        """
        num_classes = int(getattr(self.model, "num_classes", 0))
        if num_classes:
            if labels is None:
                raise ValueError(
                    f"this model is class-conditional ({num_classes} classes); pass labels"
                )
            label = jnp.asarray(_labels(labels, num_classes))
            count = len(label)
        else:
            if labels is not None:
                raise ValueError("this model is unconditional (num_classes=0); pass count=")
            if not is_whole_number(count) or count < 1:
                raise ValueError(f"count must be an int >= 1 samples, got {count!r}")
            label = None
            if (guidance if guidance is not None else self.guidance) != 1.0:
                raise ValueError("guidance needs a condition; an unconditional model has none")
        return self._run(
            count,
            label=label,
            context=None,
            null_context=None,
            num_steps=num_steps,
            guidance=guidance,
            seed=seed,
            sampler=sampler,
        )

    def save(self, path: str | os.PathLike, *, format: str | None = None) -> pathlib.Path:
        """Write the pipeline to directory ``path`` (module docstring); ``format`` None =
        :attr:`checkpoint_format` (a Hugging Face / diffusers model stays one)."""
        return self._write(path, format, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassToVideo(ClassToImage):
    """Class labels in, uint8 videos ``[batch, F, H, W, C]`` out (a ``VideoDiT``)."""

    task = "class_to_video"
    sample_rank = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextToImage(_Diffusion):
    """Prompts in, uint8 images ``[batch, H, W, C]`` out.

    text_encoder: a :class:`dew.sampling.TextEncoder` whose ``features`` are the
      model's ``context_features``: a frozen checkpoint (``TextEncoder.load``) or the
      small encoder trained with the model.
    null_context: the unconditional context of guidance, ``[max_length, features]``:
      what condition dropout trained on (``DiffusionObjective(null_context=)``, zeros
      by default there); None = the encoding of the empty prompt ``""`` (Stable
      Diffusion's choice).
    """

    text_encoder: TextEncoder
    null_context: Any = None

    task = "text_to_image"

    def __post_init__(self):
        super().__post_init__()
        if self.null_context is not None:
            null = np.asarray(self.null_context, np.float32)
            want = (self.text_encoder.max_length, self.text_encoder.features)
            if null.shape != want:
                raise ValueError(
                    f"null_context has shape {null.shape}; the text encoder's contexts are "
                    f"{want} ([max_length, features])"
                )
            object.__setattr__(self, "null_context", null)
        expected = getattr(self.model, "context_features", None)
        if expected is not None and expected != self.text_encoder.features:
            raise ValueError(
                f"the text encoder gives {self.text_encoder.features} features a token, the "
                f"model cross-attends to context_features={expected}; use the encoder it was "
                f"trained with"
            )

    def __call__(
        self,
        prompts: str | Sequence[str],
        *,
        num_steps: int | None = None,
        guidance: float | None = None,
        seed: int = 0,
        sampler: Any = None,
    ) -> np.ndarray:
        """Sample one image (video) per prompt; arguments as :meth:`ClassToImage.__call__`."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(
                f"prompts must be a string or a non-empty list of strings, got {prompts!r}"
            )
        context = self.text_encoder(texts)  # [batch, max_length, features]
        null_context = self.null_context  # [max_length, features]
        if null_context is None:
            null_context = self.text_encoder([""])[0]
        return self._run(
            len(texts),
            label=None,
            context=context,
            null_context=null_context,
            num_steps=num_steps,
            guidance=guidance,
            seed=seed,
            sampler=sampler,
        )

    def save(self, path: str | os.PathLike, *, format: str | None = None) -> pathlib.Path:
        """Write the pipeline to ``path``, the text encoder in ``path/text_encoder``."""
        path = pathlib.Path(path)
        described = {
            "directory": TEXT_ENCODER_DIRECTORY,
            "max_length": self.text_encoder.max_length,
        }
        if self.null_context is not None:
            described["null_context"] = NULL_CONTEXT_DIRECTORY
            write_tensors(path / NULL_CONTEXT_DIRECTORY, {"null_context": self.null_context})
        out = self._write(path, format, described)
        self.text_encoder.save(path / TEXT_ENCODER_DIRECTORY)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextToVideo(TextToImage):
    """Prompts in, uint8 videos ``[batch, F, H, W, C]`` out (a text-conditioned ``VideoDiT``)."""

    task = "text_to_video"
    sample_rank = 4


TASKS = {cls.task: cls for cls in (ClassToImage, ClassToVideo, TextToImage, TextToVideo)}


def read_pipeline_parts(description: dict[str, Any], directory: pathlib.Path) -> dict[str, Any]:
    """The pipeline fields a ``"diffusion"`` section keeps beside the model (the text
    encoder, its null context), read from ``directory``; empty when there are none."""
    encoder = description.get("text_encoder")
    if encoder is None:
        return {}
    out = {
        "text_encoder": TextEncoder.load(
            directory / encoder["directory"], max_length=int(encoder["max_length"])
        )
    }
    if encoder.get("null_context"):
        out["null_context"] = TensorReader(directory / encoder["null_context"])["null_context"]
    return out


def pipeline_from_description(description: dict[str, Any], *, model, params, **overrides):
    """The pipeline a ``"diffusion"`` section describes, over ``model`` and ``params``;
    ``overrides`` replace fields (``text_encoder=`` for a text-conditioned one)."""
    task = description.get("task")
    if task not in TASKS:
        raise ValueError(f"unknown diffusion task {task!r}; expected one of {sorted(TASKS)}")
    if task.startswith("text_") and "text_encoder" not in overrides:
        raise ValueError(f"a {task} pipeline needs its text encoder (text_encoder=)")
    fields = dict(
        model=model,
        params=params,
        schedule=schedule_from_json(description["schedule"]),
        target=description["target"],
        sample_shape=tuple(description["sample_shape"]),
        sampler=_sampler_from_json(description.get("sampler")),
        num_steps=description.get("num_steps"),
        guidance=float(description.get("guidance", 1.0)),
        has_null_condition=bool(description.get("has_null_condition", True)),
        clip_denoised=description.get("clip_denoised"),
    )
    return TASKS[task](**{**fields, **overrides})


def default_description(model) -> dict[str, Any]:
    """How a denoiser without a ``"diffusion"`` section (a diffusers
    ``DiTTransformer2DModel`` directory) is sampled: DiT's training, a linear DDPM
    schedule of 1000 steps with an eps target (learned sigma when the model has
    ``2 C`` outputs), the null class known, DDIM with 50 steps, guidance 1 (call with
    ``guidance=4.0`` as the DiT paper's samples)."""
    height, width = model.sample_shape
    return {
        "task": "class_to_image",
        "schedule": schedule_to_json(DDPMSchedule(kind="linear", num_timesteps=1000)),
        "target": "eps",
        "sample_shape": [height, width, model.in_channels],
        "sampler": {"name": "ddim"},
        "num_steps": 50,
        "guidance": 1.0,
        "has_null_condition": bool(getattr(model, "num_classes", 0)),
        "clip_denoised": 1.0,
        "text_encoder": None,
    }
