"""The objective contract: what the trainer asks of every kind of training.

An objective initialises the variables, computes the loss, evaluates,
previews samples, names the weights that keep a moving average, and wraps
trained weights into an inference task. Everything it needs is a
constructor argument; nothing is global.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Variables = dict[str, Any]
Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class Step:
    """What one attempt of the training step knows about itself.

    index: the step counter (attempts, ``TrainState.step``), an int32 scalar.
    key: this attempt's PRNG key, ``fold_in(fold_in(root, step), microbatch)``:
      every draw of a run is a pure function of the root key, the step and the
      microbatch, so a resumed run repeats the same draws.
    """

    index: jax.Array
    key: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class EMA:
    """Which parameters keep an exponential moving average, and how fast.

    decay: the averaging factor per optimizer update, or a function of the
      update count returning it (a schedule).
    warmup_steps: ramp the decay linearly from 0 to ``decay`` over this many
      updates so early averages follow the weights; 0 = no ramp.
    include: ``include(path) -> bool`` over '/'-joined parameter paths
      (``"layers/mlp/up/kernel"``); None averages every parameter. Leaves
      not included hold the live values in ``TrainState.averaged``.
    """

    decay: float | Callable[[jax.Array], jax.Array] = 0.999
    warmup_steps: int = 0
    include: Callable[[str], bool] | None = None

    def __post_init__(self):
        if not callable(self.decay) and not 0.0 <= self.decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {self.decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"EMA warmup_steps must be >= 0, got {self.warmup_steps}")

    def decay_at(self, updates: jax.Array) -> jax.Array:
        """The decay applied at optimizer update number ``updates`` (0-based)."""
        updates = jnp.asarray(updates, jnp.float32)
        decay = self.decay(updates) if callable(self.decay) else jnp.float32(self.decay)
        if self.warmup_steps:
            decay = decay * jnp.minimum(1.0, updates / self.warmup_steps)
        return decay


class Objective:
    """Base class of every objective. Subclasses set ``model`` and implement
    :meth:`init` and :meth:`loss`; the rest is optional.

    Attributes:
      model: the trained ``flax.linen.Module``.
      ema: an :class:`EMA`, or None to keep no moving average.
      uses_averaged: the loss reads the moving average (JEPA's target encoder):
        the trainer passes it as ``variables['averaged']``.
      evaluate_averaged: evaluation, previews and pipelines use the averaged
        weights when there are any.
    """

    model: Any
    ema: EMA | None = None
    uses_averaged: bool = False
    evaluate_averaged: bool = True

    def init(self, key: jax.Array) -> Variables:
        """``{'params': ..., plus frozen collections}``; parameters may be
        ``nn.LogicallyPartitioned`` boxes (the trainer shards and unboxes them)."""
        raise NotImplementedError

    def loss(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """``(scalar loss, metrics dict of scalars)``; metrics carry sums and counts."""
        raise NotImplementedError

    def evaluate(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step) -> Metrics:
        """Sums and counts over one validation batch (the trainer adds them up)."""
        raise NotImplementedError

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Turn evaluation totals (sums over batches) into the reported numbers."""
        return dict(totals)

    def preview(self, variables: Variables, key: jax.Array) -> Any:
        """A sample to log (text, images, video); None = nothing to show."""
        return None

    def pipeline(self, state) -> Any:
        """An inference task wrapping the trained weights."""
        raise NotImplementedError(f"{type(self).__name__} has no inference pipeline")

    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """Validate one host batch before it is compiled against; raise ValueError."""

    @property
    def has_evaluate(self) -> bool:
        return type(self).evaluate is not Objective.evaluate

    @property
    def has_preview(self) -> bool:
        return type(self).preview is not Objective.preview
