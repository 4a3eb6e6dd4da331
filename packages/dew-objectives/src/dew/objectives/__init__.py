"""dew.objectives: what is learned. One family a module (``dew.objectives.lm``, ...).

The contract (:class:`Objective`, documented in ``docs/concepts.md``):

- models by role (:class:`Role`): trained ones (one or several) and frozen ones
  (reference, teacher, text encoder), each recorded by registry name and config;
- ``init(key, spec)`` -> variables, with shapes from the data's batch spec;
- optional ``prepare(variables, batch, step)``: compiled, no gradient, on the
  pre-update weights; turns a data batch into a training batch (rollouts,
  rewards, reference log-probs, advantages), then ``prepared_updates``
  (:class:`Updates`, epochs x minibatches) optimizer updates run over it;
- ``loss(variables, batch, step)`` -> (loss, metrics), values with their weights
  (:class:`Weighted`, :class:`Summed`), so accumulation divides once;
- optional ``evaluate`` / ``summarize`` / ``preview``; ``ema``; ``export(variables)``
  -> an inference task, with ``pipeline(state)`` a thin call of it.
"""

from dew.objectives.base import (
    EMA,
    Metrics,
    Objective,
    Role,
    Step,
    Updates,
    Variables,
    with_initial_values,
)
from dew.objectives.weighted import Summed, Weighted

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "Metrics",
    "Objective",
    "Role",
    "Step",
    "Summed",
    "Updates",
    "Variables",
    "Weighted",
    "with_initial_values",
]
