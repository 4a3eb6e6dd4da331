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

    params_by_role: the live parameters (the optimized collection), ``{trained role:
      its tree}`` whatever the number of trained roles (what the objective reads as
      ``variables['params']``; the optimizer state mirrors it). :attr:`params` is
      the seed's view of it.
    opt_state: the optax state.
    key: the run's PRNG key; step ``s`` draws from ``fold_in(key, s)``.
    step: attempts, accepted or rejected (int32).
    microstep: accepted microbatches (int32).
    updates: optimizer updates applied (int32).
    averaged_by_role: ``params_by_role`` with moving-average values at the leaves
      the objective's EMA (or an averaged role's) covers and live values elsewhere;
      None without an EMA. :attr:`averaged` is the seed's view of it.
    frozen: the objective's other collections, by frozen role name
      (``frozen['reference']['params']``: a reference policy, a teacher, a text
      encoder), checkpointed and never optimized or averaged. Under LoRA,
      ``frozen['lora_base'][role]`` holds an adapted role's base weights, and
      ``params_by_role[role]`` only its adapters.
    lora_views: ``(frozen role, trained role)`` pairs: frozen roles declared
      ``Role(initial_from=...)`` a LoRA role (its initial policy): the base without
      adapters, built from ``frozen['lora_base']`` with zero adapters and stored
      nowhere.
    averaged_roles: ``(averaged role, trained role)`` pairs: roles declared
      ``Role(averages=...)`` (JEPA's ``target``), read from ``averaged_by_role`` at
      the trained role and stored nowhere else.
    evaluate_averaged: :meth:`variables` gives the moving average by default: the
      objective keeps one and evaluates, previews and exports with it
      (``Objective.evaluate_averaged``; the trainer sets it). Not an array: it is
      part of the tree's structure, like ``lora_views``.
    """

    params_by_role: Any
    opt_state: Any
    key: jax.Array
    step: jax.Array
    microstep: jax.Array
    updates: jax.Array
    averaged_by_role: Any = None
    frozen: Any = flax.struct.field(default_factory=dict)
    lora_views: tuple[tuple[str, str], ...] = flax.struct.field(pytree_node=False, default=())
    averaged_roles: tuple[tuple[str, str], ...] = flax.struct.field(pytree_node=False, default=())
    evaluate_averaged: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def params(self) -> Any:
        """The live parameters as the seed showed them: the trained role's tree when
        the objective trains one role, else ``{role: tree}`` (:attr:`params_by_role`)."""
        return one_role(self.params_by_role)

    @property
    def averaged(self) -> Any:
        """:attr:`params` with the moving-average weights in place (the trained role's
        tree when the objective trains one role); None without an average."""
        return one_role(self.averaged_by_role)

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
        average = self.averaged_by_role
        return self.variables_with(
            average if (averaged and average is not None) else self.params_by_role
        )

    def variables_with(self, params) -> dict[str, Any]:
        """What the objective reads with ``params`` (``{trained role: tree}``) as the
        trained parameters: ``{'params': params, **frozen}``, each averaged role
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
                adapters = split(params[trained])[1]
                zeros = jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(adapters))
                out[role] = {"params": merge(base[trained], zeros)}
        for role, trained in self.averaged_roles:
            tree = jax.lax.stop_gradient(self.averaged_by_role)[trained]
            if base is not None and trained in base:
                from dew.nn.lora import merge

                tree = merge(base[trained], tree)
            out[role] = {"params": tree}
        return out


def one_role(tree: Any) -> Any:
    """``tree`` (``{trained role: its tree}``) as the seed showed it: the one role's
    tree when it holds one role, else itself (None stays None)."""
    if isinstance(tree, dict) and len(tree) == 1:
        return next(iter(tree.values()))
    return tree
