"""The objective contract: what the trainer asks of every kind of training.

An objective initialises the variables, computes the loss, evaluates,
previews samples, names the weights that keep a moving average, and wraps
trained weights into an inference task. Everything it needs is a
constructor argument; nothing is global.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dew.objectives.contract.batch import BatchField, check_batch_spec, spec_of
from dew.objectives.contract.phases import PHASES, Phases, check_phases, default
from dew.objectives.contract.roles import (
    ROLE_NAMES,
    Role,
    check_roles,
    check_same_shapes,
    initial_source,
    nn_unbox,
    with_initial_values,
)
from dew.objectives.contract.step import EMA, Step, Updates, warmup_ema_decay

__all__ = [
    "EMA",
    "PHASES",
    "ROLE_NAMES",
    "Metrics",
    "Objective",
    "Role",
    "Step",
    "Updates",
    "Variables",
    "check_phases",
    "check_roles",
    "check_same_shapes",
    "set_canonical",
    "initial_source",
    "nn_unbox",
    "warmup_ema_decay",
    "with_initial_values",
]

Variables = dict[str, Any]
Metrics = dict[str, jax.Array]


class Objective(Phases):
    """Base class of every objective. Subclasses set ``model`` (or override
    :meth:`roles`) and implement :meth:`init` and :meth:`loss`; the rest is
    optional.

    Attributes:
      model: the trained ``flax.linen.Module`` of a one-model objective.
      ema: an :class:`EMA` of every trained parameter (``TrainState.averaged``, what
        sampling and evaluation read), or None. A moving average the loss reads is a
        role instead (``Role(name='target', averages='encoder', ema=...)``).
      evaluate_averaged: evaluation, previews and exports use the averaged
        weights when there are any.
      prepared_updates: with :meth:`prepare`, the optimizer updates each prepared batch
        feeds (:class:`Updates`); ignored without it.
      headline_metrics: metric names the trainer prints on each log line after the
        loss (``("reward", "kl")``); every metric is in ``metrics.jsonl`` regardless.
      phases: the optional prepare phases it has (:mod:`dew.objectives.contract.phases`):
        ``()``, ``("prepare",)`` or ``("prepare", "prepare_host", "prepare_finish")``.

    The loss's value and metrics may carry weights (:mod:`dew.objectives.contract.weighted`):
    a plain scalar means equal weight per example row.
    """

    model: Any
    ema: EMA | None = None
    evaluate_averaged: bool = True
    prepared_updates: Updates = Updates()
    headline_metrics: tuple[str, ...] = ()

    def roles(self) -> tuple[Role, ...]:
        """The models this objective uses, named from :data:`ROLE_NAMES`, with their
        relations (``initial_from``, ``averages``). Default: one trained role,
        ``policy``.

        The trained parameters are keyed by role, whatever their number:
        ``variables['params'][role]`` (``variables['params']['policy']``), as ``init``
        returns them. A frozen or averaged role's variables are ``variables[role]``
        (``variables['reference']['params']``, ``variables['target']['params']``).
        """
        return (Role(name="policy", module=self.model),)

    @property
    def keeps_average(self) -> bool:
        """The trainer keeps a moving average (``TrainState.averaged``): the
        objective's ``ema``, or a role that averages a trained one."""
        return self.ema is not None or any(r.averages is not None for r in self.roles())

    def init(self, key: jax.Array, spec: Mapping[str, Any] | None = None) -> Variables:
        """``{'params': {trained role: its tree}, frozen role name: its variables, ...}``
        (``{'params': {'policy': model.init(...)['params']}}``); parameters may be
        ``nn.LogicallyPartitioned`` boxes (the trainer shards and unboxes them).

        spec: the data's batch spec, ``{key: Field(shape per row, dtype)}``
          (``dew.data.Dataset.spec``; None when the data declares none), so shapes
          are stated once, by the data. The one form; a seed-style
          ``init(self, key)`` still runs, with a DeprecationWarning
          (:meth:`~dew.objectives.contract.phases.Phases.initialize`).
        """
        raise NotImplementedError

    def accumulate_for(self, data_parallel: int) -> int | None:
        """The trainer's accumulation (microbatches per update) when the objective
        sizes its own microbatches from the ``data_parallel`` devices
        (``FlowGRPOObjective(device_rows=...)``); None (the default) = the trainer's own
        ``accumulate`` applies. A number here replaces it: the trainer's
        ``accumulate`` must then be 1 or that number."""
        return None

    def loss(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """``(loss, metrics)``: the loss a scalar (a mean, equal weight per row), a
        ``Weighted`` or a tuple of ``Weighted`` terms; metrics scalars, ``Weighted``
        or ``Summed`` (:mod:`dew.objectives.contract.weighted`)."""
        raise NotImplementedError

    @default
    def evaluate(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step) -> Metrics:
        """Metrics of one validation batch, as in :meth:`loss`; the trainer adds
        them up over the pass (weights and totals separately) and reduces once."""
        raise NotImplementedError

    def summarize(self, results: Mapping[str, float]) -> dict[str, float]:
        """Add derived numbers to the reduced evaluation results (e.g. perplexity)."""
        return dict(results)

    def log_notes(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Lines the trainer prints after the training log line of ``step`` (on the
        host, from its reduced ``metrics``): warnings such as JEPA's collapse alarm.
        Default: none."""
        return []

    @default
    def preview(self, variables: Variables, key: jax.Array) -> Any:
        """A sample to log (text, images, video); None = nothing to show."""
        return None

    def export(self, variables: Variables) -> Any:
        """An inference task (``TextGeneration``, ...) wrapping these variables: a
        live run's, a checkpoint's or a Hugging Face load's."""
        raise NotImplementedError(f"{type(self).__name__} has no inference pipeline")

    def inference_task(self, state) -> Any:
        """``export`` of a ``TrainState``'s variables (the averaged ones when the
        objective evaluates with them): the inference task of a training run."""
        averaged = self.evaluate_averaged and self.keeps_average
        return self.export(state.variables(averaged=averaged))

    def pipeline(self, state) -> Any:
        """Deprecated name of :meth:`inference_task` ("pipeline" also names GPipe stages
        and ``Pretrained.pipeline``)."""
        warnings.warn(
            f"{type(self).__name__}.pipeline(state) is now inference_task(state)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.inference_task(state)

    def batch_fields(self) -> tuple[BatchField, ...]:
        """The batch keys this objective reads, with each row's shape and the dtypes it
        takes (:class:`dew.objectives.contract.batch.BatchField`); () = not declared. The
        trainer matches them against ``Dataset.spec`` once, before compiling
        (:func:`dew.objectives.contract.batch.check_batch_spec`)."""
        return ()

    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """Validate one host batch before it is compiled against: its shapes against
        :meth:`batch_fields` (for data that declares no spec), then, in subclasses,
        the values (out-of-vocabulary ids, ties, empty completions)."""
        check_batch_spec(self.batch_fields(), spec_of(batch), what=type(self).__name__)


def set_canonical(objective, **numbers) -> None:
    """Store checked numbers in their canonical type (``np.float32(2.0)`` -> ``2.0``):
    the one write a frozen objective's ``__post_init__`` makes, always of an equal
    value (numbers in every numeric form are accepted and kept as Python numbers)."""
    for name, value in numbers.items():
        if not bool(value == getattr(objective, name)):
            raise AssertionError(f"{name}: {value!r} is not the value given")
        object.__setattr__(objective, name, value)
