"""Rewards of generated images: jittable functions of uint8 images (or float samples)
and host Python functions, weighted and summed (Flow-GRPO's reward protocol).

    r_i = sum_k w_k r_k(x_i)

- :class:`ImageReward`: ``fn(images, batch) -> [rows]``, traced into the compiled
  rollout; ``images`` uint8 ``[rows, H, W, C]`` (``pixels=True``) or the float
  samples as drawn (latents, 2-D points).
- :class:`HostImageReward`: ``fn(images, **columns) -> [rows]`` on the host, once per
  rollout batch, between the compiled rollout and the compiled advantages (a
  detector, OCR, a model served elsewhere); a plain callable is one of weight 1.

Each is logged as ``reward/<name>``. A reward that returns the wrong shape or a
non-finite value, or raises, is a :class:`~dew.objectives.cores.rewards.RewardError`
naming the function and the sample (``sample 9 (condition 1 of the batch, sample 1
of its group of 8)``), before any update of the batch.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.cores.rewards import (
    RewardError,
    RewardSet,
    accepted_columns,
    check_reward,
    gather_rewards,
)
from dew.sampling.diffusion.pipelines import to_pixels

__all__ = ["HostImageReward", "ImageReward", "ImageRewards", "pixels_of"]


def pixels_of(x: jax.Array) -> jax.Array:
    """Samples in ``[-1, 1]`` as uint8 pixels ``round((x + 1) 127.5)`` clipped (traced)."""
    return jnp.clip(jnp.round((x.astype(jnp.float32) + 1.0) * 127.5), 0, 255).astype(jnp.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageReward:
    """A jittable reward of samples, traced into the compiled rollout.

    fn: ``fn(images, batch) -> float[rows]``; ``images`` uint8 ``[rows, H, W, C]``
      (``pixels=True``) or the float32 samples as drawn (latents, points); ``batch``
      every key of the data batch (the label too), each row repeated per group sample.
    weight: its coefficient in the summed reward.
    name: the metric name (``reward/<name>``); "" = ``fn.__name__``.
    pixels: give ``fn`` uint8 pixels (True) or the float samples (False).
    """

    fn: Callable
    weight: float = 1.0
    name: str = ""
    pixels: bool = True

    def __post_init__(self):
        check_reward(self)

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", None) or type(self.fn).__name__


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostImageReward(ImageReward):
    """A host Python reward (a detector, OCR, a model served elsewhere), called once per
    rollout batch between the compiled rollout and the compiled advantages.

    fn: ``fn(images: np.ndarray, **columns) -> sequence of rows floats``; ``images``
      as :class:`ImageReward`'s (numpy); ``columns`` every key of the data batch,
      numpy rows repeated per group sample (those ``fn``'s signature names, all with
      ``**kwargs``).
    """


def where(row: int, group_size: int) -> str:
    """``"sample r (condition b of the batch, sample g of its group of G)"``."""
    b, g = divmod(row, group_size)
    return f"sample {row} (condition {b} of the batch, sample {g} of its group of {group_size})"


def _check_values(value: np.ndarray, rows: int, what: str, group_size: int) -> np.ndarray:
    if value.shape != (rows,):
        raise RewardError(
            f"{what} returned shape {value.shape} for {rows} samples; return one float per "
            f"sample, shape ({rows},); the step was not applied"
        )
    bad = np.flatnonzero(~np.isfinite(value))
    if bad.size:
        row = int(bad[0])
        raise RewardError(
            f"{what} returned {value[row]} for {where(row, group_size)} ({bad.size} non-finite "
            f"value(s) in the batch); the step was not applied. Rewards must be finite"
        )
    return value


@dataclasses.dataclass(frozen=True)
class ImageRewards(RewardSet):
    """An objective's image rewards in order, each with its weight (:meth:`of`)."""

    items: tuple[ImageReward, ...]

    @classmethod
    def of(cls, rewards) -> ImageRewards:
        """From ``rewards=[...]``: :class:`ImageReward`, :class:`HostImageReward` or plain
        callables (host rewards of weight 1)."""
        return cls(
            gather_rewards(
                rewards,
                (ImageReward,),
                HostImageReward,
                hint="rewards=[ImageReward(fn=...)] (jittable) or [HostImageReward(fn=...)] "
                "(host Python; a plain callable is one)",
            )
        )

    @property
    def compiled(self) -> tuple[ImageReward, ...]:
        return tuple(r for r in self.items if not isinstance(r, HostImageReward))

    @property
    def host(self) -> tuple[HostImageReward, ...]:
        return tuple(r for r in self.items if isinstance(r, HostImageReward))

    def compiled_values(self, samples: jax.Array, batch) -> jax.Array:
        """``[rows, compiled rewards]`` float32, traced; another shape is a
        :class:`RewardError` when traced (before compiling)."""
        rows = samples.shape[0]
        columns = []
        for r in self.compiled:
            try:
                value = jnp.asarray(r.fn(pixels_of(samples) if r.pixels else samples, batch))
            except Exception as error:  # traced: no sample to name, the batch's shapes
                raise RewardError(
                    f"image reward {r.label!r} raised {type(error).__name__}: {error} while "
                    f"traced on samples of shape {tuple(samples.shape)}; nothing was applied. "
                    f"It must be a jittable function fn(images, batch) -> [rows] (a host "
                    f"Python reward is a HostImageReward)"
                ) from error
            if value.shape != (rows,):
                raise RewardError(
                    f"image reward {r.label!r} returned shape {value.shape}; it must return "
                    f"one value per sample, shape ({rows},)"
                )
            columns.append(value.astype(jnp.float32))
        return jnp.stack(columns, axis=1) if columns else jnp.zeros((rows, 0), jnp.float32)

    def host_stage(self, samples, compiled, columns, group_size: int) -> np.ndarray:
        """``[rows, rewards]`` float32 in :attr:`names` order: the compiled values checked,
        each host reward called once and checked (a :class:`RewardError` names the
        function and the sample)."""
        rows = samples.shape[0]
        compiled = np.asarray(compiled, np.float32)
        for k, r in enumerate(self.compiled):
            _check_values(compiled[:, k], rows, f"image reward {r.label!r}", group_size)
        host = []
        for r in self.host:
            images = to_pixels(samples) if r.pixels else np.asarray(samples, np.float32)
            kwargs = accepted_columns(r.fn, columns)
            what = f"host image reward {r.label!r}"
            try:
                value = r.fn(images, **kwargs)
            except Exception as error:
                row = _first_failing_row(r.fn, images, kwargs)
                at = where(row, group_size) if row is not None else f"a batch of {rows} samples"
                raise RewardError(
                    f"{what} raised {type(error).__name__}: {error} on {at}; the step was not "
                    f"applied\n{traceback.format_exc(limit=-3)}"
                ) from error
            try:
                value = np.asarray(value, np.float64)
            except (TypeError, ValueError) as error:
                raise RewardError(
                    f"{what} returned {type(value).__name__}, not a sequence of numbers "
                    f"({error}); return one float per sample ({rows})"
                ) from error
            host.append(_check_values(value, rows, what, group_size).astype(np.float32))
        c, h = iter(compiled.T), iter(host)
        cols = [next(h) if isinstance(r, HostImageReward) else next(c) for r in self.items]
        return np.stack(cols, axis=1).astype(np.float32)


def _first_failing_row(fn, images, kwargs) -> int | None:
    for row in range(images.shape[0]):
        try:
            fn(images[row : row + 1], **{k: v[row : row + 1] for k, v in kwargs.items()})
        except Exception:
            return row
    return None
