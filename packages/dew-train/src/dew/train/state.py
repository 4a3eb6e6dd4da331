"""``TrainState``: everything a run needs to continue."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax


@flax.struct.dataclass
class TrainState:
    """The state of a run.

    params: the live parameters (the optimized collection): the trained role's
      tree, or ``{role: tree}`` when the objective trains several roles.
    opt_state: the optax state.
    key: the run's PRNG key; step ``s`` draws from ``fold_in(key, s)``.
    step: attempts, accepted or rejected (int32).
    microstep: accepted microbatches (int32).
    updates: optimizer updates applied (int32).
    averaged: the parameter tree with moving-average values at the leaves the
      objective's EMA covers and live values elsewhere; None without an EMA.
    frozen: the objective's other collections, by frozen role name
      (``frozen['reference']['params']``: a reference policy, a teacher, a text
      encoder), checkpointed and never optimized or averaged.
    """

    params: Any
    opt_state: Any
    key: jax.Array
    step: jax.Array
    microstep: jax.Array
    updates: jax.Array
    averaged: Any = None
    frozen: Any = flax.struct.field(default_factory=dict)

    def variables(self, *, averaged: bool = False) -> dict[str, Any]:
        """``{'params': ..., **frozen}`` (the averaged params when asked and kept)."""
        params = self.averaged if (averaged and self.averaged is not None) else self.params
        return {"params": params, **self.frozen}
