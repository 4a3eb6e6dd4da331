"""dew.objectives: what is learned. One family a module, in folders by kind
(``dew.objectives.language.lm``, ``dew.objectives.rl.grpo``, ...).

The contract (:class:`Objective`, documented in ``docs/concepts.md``):

- the batch fields it reads (:meth:`Objective.batch_fields`, :class:`BatchField`),
  matched against ``Dataset.spec`` before compiling (:func:`check_batch_spec`);
- models by role (:class:`Role`, names from :data:`ROLE_NAMES`): trained ones (one
  or several), frozen ones (reference, teacher, text encoder) and declared relations
  (``initial_from``: a reference = the initial policy; ``averages``: JEPA's target =
  an EMA of the encoder), checked by :func:`check_roles`, each recorded by registry
  name and config;
- ``init(key, spec=None)`` -> variables, with shapes from the data's batch spec;
- declared ``phases``; optional ``prepare(variables, batch, step)``: compiled, no gradient, on the
  pre-update weights; turns a data batch into a training batch (rollouts,
  rewards, reference log-probs, advantages), then ``prepared_updates``
  (:class:`Updates`, epochs x minibatches) optimizer updates run over it;
  optional ``prepare_host(rollout)`` (host Python over numpy, e.g. rewards of
  decoded text) and a compiled ``prepare_finish`` split the phase in three;
- on-policy objectives (``grpo``, ``ppo``) generate their rollouts in
  ``prepare`` with ``dew.sampling`` on the same weights and mesh and score
  them with the loss's own log-prob function (``rollouts.rollout_logprobs``),
  so the first update's importance ratio is exactly 1
  (``check_first_ratio=True`` or ``DEW_DEBUG=1`` asserts it); rewards are
  ``cores.rewards.Reward`` objects, jitted or ``host=True`` (``TokenReward``,
  ``TextReward`` build them);
- ``loss(variables, batch, step)`` -> (loss, metrics), values with their weights
  (:class:`Weighted`, :class:`Summed`), so accumulation divides once;
- optional ``evaluate`` / ``summarize`` / ``preview``; ``ema``; ``export(variables)``
  -> an inference task, with ``inference_task(state)`` a thin call of it.
"""

from dew.objectives import _moved
from dew.objectives.contract.batch import BatchField, check_batch_spec
from dew.objectives.contract.objective import (
    EMA,
    ROLE_NAMES,
    Metrics,
    Objective,
    Role,
    Step,
    Updates,
    Variables,
    check_roles,
    with_initial_values,
)
from dew.objectives.contract.weighted import Summed, Weighted

_moved.install()

__version__ = "0.1.0"

__all__ = [
    "EMA",
    "ROLE_NAMES",
    "BatchField",
    "Metrics",
    "Objective",
    "Role",
    "Step",
    "Summed",
    "Updates",
    "Variables",
    "Weighted",
    "check_batch_spec",
    "check_roles",
    "with_initial_values",
]
