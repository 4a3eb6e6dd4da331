"""The objective's declared role relations, as the train state keeps them.

``Role(initial_from=...)`` (a reference = the initial policy) and
``Role(averages=...)`` (JEPA's target = an EMA of the encoder) are declarations
(:func:`dew.objectives.check_roles` checks them before anything is compiled); this
module turns them into the state:

- an ``initial_from`` role that ``init`` did not return is filled from its source's
  initial weights; under LoRA it becomes a view of the base instead
  (:mod:`dew.train.adapters`);
- an averaged role is not stored as a frozen collection: it is
  ``TrainState.averaged_by_role`` at its trained role (``TrainState.averaged_roles``),
  updated after every optimizer update with its own decay schedule (:func:`role_emas`).
"""

from __future__ import annotations

from typing import Any

from dew.objectives import EMA, Objective, Role
from dew.objectives.contract.objective import initial_source


def trained_names(roles: tuple[Role, ...]) -> list[str]:
    return [r.name for r in roles if r.trained]


def check_params_by_role(objective: Objective, roles: tuple[Role, ...], params) -> None:
    """Raise unless ``init``'s ``params`` are keyed by the trained roles
    (``{'policy': tree}``), whatever their number."""
    names = trained_names(roles)
    if not isinstance(params, dict) or sorted(params) != sorted(names):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"{type(objective).__name__}.init returned params {got}; trained parameters are "
            f"keyed by trained role, whatever their number: return "
            f"{{'params': {{{', '.join(f'{n!r}: ...' for n in names)}}}}} (one tree per role "
            f"of roles(), e.g. {{'params': {{'policy': model.init(...)['params']}}}})"
        )


def initial_variables(objective: Objective, roles: tuple[Role, ...], variables: dict) -> dict:
    """``init``'s variables with every ``initial_from`` role filled from its source
    (when ``init`` did not return it) and the averaged roles left out (they live in
    ``TrainState.averaged_by_role``)."""
    what = type(objective).__name__
    out = dict(variables)
    params = out["params"]
    for role in roles:
        if role.averages is not None:
            out.pop(role.name, None)
    for role in roles:
        if role.trained or role.averages is not None or role.name in out:
            continue
        if role.initial_from is None:
            raise ValueError(
                f"{what}.init returned no variables for frozen role {role.name!r} (it "
                f"returned {sorted(variables)}); return {{'{role.name}': {{'params': ...}}}}, "
                f"or declare Role({role.name!r}, initial_from='<role>') to start it from "
                f"another role's initial weights"
            )
        source = initial_source(roles, role.name)
        if source.trained:
            tree = params[source.name]
        elif source.name in out:
            tree = out[source.name]["params"]
        else:
            raise ValueError(
                f"{what}: Role({role.name!r}) starts from frozen role {source.name!r}, "
                f"whose variables init did not return; return them from init"
            )
        out[role.name] = {"params": tree}
    return out


def averaged_roles(roles: tuple[Role, ...]) -> tuple[tuple[str, str], ...]:
    """``(averaged role, its trained role)`` pairs (``TrainState.averaged_roles``)."""
    return tuple((r.name, r.averages) for r in roles if r.averages is not None)


def role_emas(objective: Objective, roles: tuple[Role, ...]) -> dict[str, EMA]:
    """``{trained role: EMA}`` of the averaged roles: each role's own ``ema``, else
    the objective's."""
    return {r.averages: r.ema or objective.ema for r in roles if r.averages is not None}


def keeps_average(objective: Objective, roles: tuple[Role, ...]) -> bool:
    """Whether the state keeps ``averaged``: the objective's ``ema`` or an averaged role."""
    return objective.ema is not None or any(r.averages is not None for r in roles)


def evaluates_averaged(objective: Objective, roles: tuple[Role, ...]) -> bool:
    """Evaluation, previews and exports read the moving average: the objective keeps
    one and evaluates with it (``Objective.evaluate_averaged``)."""
    return bool(objective.evaluate_averaged and keeps_average(objective, roles))


def relations_record(role: Role) -> dict[str, Any]:
    """A role's declared relations as a checkpoint records them."""
    record: dict[str, Any] = {}
    if role.initial_from is not None:
        record["initial_from"] = role.initial_from
    if role.averages is not None:
        record["averages"] = role.averages
    return record
