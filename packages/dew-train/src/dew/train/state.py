"""``TrainState``: everything a run needs to continue."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

LORA_BASE = "lora_base"
"""Where ``TrainState.frozen`` keeps the base weights of LoRA roles."""


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
      encoder), checkpointed and never optimized or averaged. Under LoRA,
      ``frozen['lora_base']`` holds the adapted roles' base weights (nested as
      ``params`` is), and ``params`` only their adapters.
    lora_views: ``(frozen role, trained role or None)`` pairs: frozen roles declared
      ``Role(initial_from=...)`` a LoRA role (its initial policy): the base without
      adapters, built from ``frozen['lora_base']`` with zero adapters and stored
      nowhere (None: the only trained role).
    averaged_roles: ``(averaged role, trained role or None)`` pairs: roles declared
      ``Role(averages=...)`` (JEPA's ``target``), read from ``averaged`` at the
      trained role's place (None: the only trained role) and stored nowhere else.
    evaluate_averaged: :meth:`variables` gives the moving average by default: the
      objective keeps one and evaluates, previews and exports with it
      (``Objective.evaluate_averaged``; the trainer sets it). Not an array: it is
      part of the tree's structure, like ``lora_views``.
    """

    params: Any
    opt_state: Any
    key: jax.Array
    step: jax.Array
    microstep: jax.Array
    updates: jax.Array
    averaged: Any = None
    frozen: Any = flax.struct.field(default_factory=dict)
    lora_views: tuple[tuple[str, str | None], ...] = flax.struct.field(
        pytree_node=False, default=()
    )
    averaged_roles: tuple[tuple[str, str | None], ...] = flax.struct.field(
        pytree_node=False, default=()
    )
    evaluate_averaged: bool = flax.struct.field(pytree_node=False, default=False)

    def with_structure(self, other: TrainState) -> TrainState:
        """This state with ``other``'s static fields (the tree's structure, not
        arrays): a restored state takes the run's own."""
        return self.replace(
            lora_views=other.lora_views,
            averaged_roles=other.averaged_roles,
            evaluate_averaged=other.evaluate_averaged,
        )

    def variables(self, *, averaged: bool | None = None) -> dict[str, Any]:
        """``{'params': ..., **frozen}``: what evaluation, sampling and export read.

        averaged: True = the moving-average params (when kept), False = the live
          ones; None = :attr:`evaluate_averaged`: the average wherever the
          objective keeps one and evaluates with it (``ema=`` given and
          ``Objective.evaluate_averaged``), the live weights otherwise. So
          ``objective.sample(state.variables())`` and
          ``objective.export(state.variables())`` read the EMA weights, as
          evaluation and previews do.
        """
        if averaged is None:
            averaged = self.evaluate_averaged
        params = self.averaged if (averaged and self.averaged is not None) else self.params
        return self.variables_with(params)

    def variables_with(self, params) -> dict[str, Any]:
        """What the objective reads with ``params`` as the trained parameters:
        ``{'params': params, **frozen}``, each averaged role
        (``{'params': averaged at its trained role}``, without gradient) and, under
        LoRA, the base merged with the adapters (``dew.nn.lora.merge``) and each
        base view."""
        frozen = dict(self.frozen)
        base = frozen.pop(LORA_BASE, None)
        if base is None:
            out = {"params": params, **frozen}
        else:
            from dew.nn.lora import merge, split

            out = {"params": merge(base, params), **frozen}
            for role, trained in self.lora_views:
                role_base = base if trained is None else base[trained]
                adapters = split(params if trained is None else params[trained])[1]
                zeros = jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(adapters))
                out[role] = {"params": merge(role_base, zeros)}
        for role, trained in self.averaged_roles:
            averaged = jax.lax.stop_gradient(self.averaged)
            tree = averaged if trained is None else averaged[trained]
            if base is not None and (trained is None or trained in base):
                from dew.nn.lora import merge

                tree = merge(base if trained is None else base[trained], tree)
            out[role] = {"params": tree}
        return out
