"""LoRA in the train state: only the adapters are trained; the base is frozen, once.

A trained role whose module came from :meth:`dew.nn.lora.LoRA.apply` initialises
base weights and adapters together (the objective's ``init``, unchanged). The
trainer then keeps

    TrainState.params_by_role[role]        the adapters (``*_lora_a``, ``*_lora_b``) of a
                                           LoRA role, the whole tree of another
    TrainState.frozen['lora_base'][role]   a LoRA role's base weights: never in the
                                           optimizer state, the moving average or the
                                           gradient

and the objective reads ``merge(base, adapters)`` (:meth:`TrainState.variables_with`),
so its ``loss``, ``prepare``, ``evaluate`` and ``export`` see the full tree and
need no LoRA code. A frozen role declared ``Role(initial_from=<LoRA role>)`` (a
reference policy that is the initial policy) becomes a *view*: the base with zero
adapters, built inside the step and stored nowhere, so the weights are held once
in memory and in checkpoints. The declaration decides, not the arrays ``init``
returned for it (those are dropped).
"""

from __future__ import annotations

from typing import Any

from dew.nn.lora import lora_of, split
from dew.objectives import Role
from dew.objectives.contract.objective import initial_source
from dew.train.state import LORA_BASE


def lora_roles(roles: tuple[Role, ...]) -> dict[str, Any]:
    """``{trained role name: LoRA}`` of the trained roles built with adapters."""
    return {r.name: lora_of(r.module) for r in roles if r.trained and lora_of(r.module)}


def split_lora(roles: tuple[Role, ...], params, frozen: dict):
    """``(params, frozen, views)`` of the initial state: adapters as the trained
    parameters, the base under ``frozen['lora_base']``, the frozen roles declared
    ``initial_from`` a LoRA role turned into views. Unchanged when no role has LoRA."""
    loras = lora_roles(roles)
    if not loras:
        return params, frozen, ()
    if LORA_BASE in frozen:
        raise ValueError(
            f"a frozen role is named {LORA_BASE!r}, the name the trainer keeps LoRA base "
            f"weights under; rename that role"
        )
    base, params = {}, dict(params)
    for name in loras:
        base[name], params[name] = split(params[name])
    frozen = dict(frozen)
    views = []
    for role in roles:
        if role.trained or role.initial_from is None or role.averages is not None:
            continue
        source = initial_source(roles, role.name)
        if source.name in loras:
            views.append((role.name, source.name))
            frozen.pop(role.name, None)
    frozen[LORA_BASE] = base
    return params, frozen, tuple(views)
