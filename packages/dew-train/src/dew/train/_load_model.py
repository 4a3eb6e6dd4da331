"""``load_model``: a model and its weights rebuilt from a checkpoint directory alone,
by role: a trained role, a frozen one, an averaged one (``Role(averages=...)``), or
the LoRA base a ``Role(initial_from=...)`` view stands for."""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from dew.train._checkpoint_dirs import incomplete_because, read_text, step_dirs
from dew.train._integrity import read_recorded, verify
from dew.train._layout import LAYOUT, layout_of
from dew.train._restore import quiet_orbax


def load_model(
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    averaged: bool | None = None,
    role: str | None = None,
) -> tuple[Any, Any]:
    """``(model, params)`` rebuilt from a checkpoint directory alone.

    The model comes from the registry name and config stored with the
    checkpoint (``dew.nn.models.build``); params are the newest committed
    checkpoint's (or ``step``'s), on the default device.

    averaged: None (the default) follows the checkpoint: the moving-average weights
      (``TrainState.averaged``) when the run kept an average and evaluated with it
      (an objective's ``ema``, or an averaged role such as JEPA's ``target``, with
      ``Objective.evaluate_averaged``), the weights its evaluation, previews and
      exports read (``TrainState.variables()``); else the live ones. True = the
      moving average (ValueError when the run kept none); False = the live
      weights. A frozen role has no average: None gives its weights, True raises.
    role: which of the objective's models (``Objective.roles()``, by their names
      in ``dew.objectives.ROLE_NAMES``): a trained one (``"policy"``,
      ``"encoder"``), a frozen one (``"reference"``, ``"teacher"``), an averaged
      one (``"target"``: the moving average of the role it averages, whatever
      ``averaged`` says) or a LoRA base view (``Role(initial_from=...)`` a LoRA role:
      the base model without adapters); None = the trained parameters as
      ``TrainState.params`` shows them (the trained role's tree when the objective
      trains one, else a dict by role) with the first trained role's model.
    """
    directory = os.path.abspath(os.fspath(directory))
    candidates = [path for s, path in step_dirs(directory) if step is None or s == step]
    skipped = []
    for path in candidates:
        why = incomplete_because(path)
        if why is None:
            if skipped:
                print(f"load_model: skipped {'; '.join(skipped)}")
            return _load_model(path, averaged=averaged, role=role)
        skipped.append(f"{path} ({why})")
    found = sorted(s for s, path in step_dirs(directory) if incomplete_because(path) is None)
    raise FileNotFoundError(
        f"no committed checkpoint{'' if step is None else f' for step {step}'} in {directory} "
        f"(committed steps: {found}{'; skipped ' + '; '.join(skipped) if skipped else ''}); "
        f"train with Trainer(..., checkpoints=Checkpoints(directory)) first"
    )


def _trained(roles: dict) -> list[str]:
    return [name for name, r in roles.items() if r.get("trained", True)]


def _source(roles: dict, name: str) -> str:
    """The role whose initial weights ``name`` starts from (its ``initial_from``
    chain's end; an averaged role's trained role)."""
    seen = {name}
    while roles[name].get("initial_from") in roles and roles[name]["initial_from"] not in seen:
        name = roles[name]["initial_from"]
        seen.add(name)
    return roles[name].get("averages", name)


def reads_average(meta: dict) -> bool:
    """Whether the run of checkpoint ``meta`` evaluated, previewed and exported with
    its moving average (``load_model``'s default). A checkpoint written before
    ``evaluate_averaged`` was recorded: whether it keeps one (every Dew family then
    evaluated with it)."""
    return bool(meta.get("evaluate_averaged", meta.get("averaged", False)))


def _role_place(path: str, meta: dict, role: str | None, averaged: bool | None):
    """``(model record, tree path, LoRA of the adapters there or None)`` of ``role``
    in the saved state; ``averaged`` None follows the checkpoint (:func:`reads_average`)."""
    use_average = reads_average(meta) if averaged is None else averaged
    field = "averaged" if use_average else "params"
    roles = meta.get("roles")
    if not roles:  # written before roles were recorded: one model
        if role is not None:
            raise KeyError(
                f"checkpoint {path} has no role {role!r}; its roles are "
                f"['(one unnamed model: pass role=None)']"
            )
        return meta.get("model"), (field,), None
    # in layout 1 (dew.train._layout), one trained role's tree was not keyed
    keyed = layout_of(path, meta) >= LAYOUT
    trained = _trained(roles)
    if role is None:  # the trained parameters: one role's tree, or all of them by role
        first = roles[trained[0]]
        if len(trained) == 1 and keyed:
            return first.get("model"), (field, trained[0]), first.get("lora")
        return meta.get("model"), (field,), first.get("lora")
    if role not in roles:
        raise KeyError(
            f"checkpoint {path} has no role {role!r}; its roles are {sorted(roles)}: pass "
            f"one of them"
        )
    record = roles[role]
    unkeyed = len(trained) == 1 and not keyed

    def at(field, trained):
        return (field,) if unkeyed else (field, trained)

    if record.get("trained", True):
        return record.get("model"), at(field, role), record.get("lora")
    if record.get("averages") in roles:  # an averaged role: the moving average itself
        trained = record["averages"]
        return record.get("model"), at("averaged", trained), roles[trained].get("lora")
    if averaged:
        raise ValueError(
            f"role {role!r} of checkpoint {path} is frozen and keeps no moving average; "
            f"load it with averaged=False"
        )
    source = _source(roles, role)
    if "initial_from" in record and roles.get(source, {}).get("lora"):
        # a view: the LoRA role's base without adapters, stored once
        base = ("frozen", "lora_base") if unkeyed else ("frozen", "lora_base", source)
        return record.get("model"), base, None
    return record.get("model"), ("frozen", role, "params"), None


def _load_model(path: str, *, averaged: bool | None, role: str | None = None) -> tuple[Any, Any]:
    from dew.nn import models

    meta = json.loads(read_text(os.path.join(path, "meta", "metadata")))
    record, where, lora = _role_place(path, meta, role, averaged)
    if not record:
        note = meta.get("model_note", "")
        if role is not None:
            note = meta.get("roles", {}).get(role, {}).get("model_note", note)
        raise ValueError(
            f"checkpoint {path} does not record the model of "
            f"{'its model' if role is None else f'role {role!r}'} ({note}); register the "
            f"model with @dew.nn.models.register so runs can rebuild it"
        )
    model = models.build(record["name"], **record["config"])
    state_dir = os.path.join(path, "state")
    params = _restore_at(path, state_dir, where, where[0] == "averaged")
    if lora is None:
        return model, params
    # a LoRA role: the adapters merged with the base the state keeps once
    from dew.nn.lora import LoRA, merge

    base = _restore_at(path, state_dir, ("frozen", "lora_base", *where[1:]), False)
    return LoRA(**lora).apply(model), merge(base, params)


def _restore_at(path: str, state_dir: str, where: tuple, averaged: bool):
    """The subtree of the saved state at ``where``, restored on one device."""
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with quiet_orbax():
        tree = ocp.StandardCheckpointer().metadata(state_dir).item_metadata.tree
        subtree = tree
        for key in where:
            subtree = subtree.get(key) if isinstance(subtree, dict) else None
            if not subtree:
                break
        if not subtree:
            raise ValueError(
                f"checkpoint {path} keeps no moving average (its objective had no "
                f"ema); load it with averaged=False"
                if averaged
                else f"checkpoint {path} holds nothing at {'/'.join(where)}"
            )
        leaf = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), subtree
        )
        target = leaf
        for key in reversed(where):
            target = {key: target}
        restored = ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    meta = json.loads(read_text(os.path.join(path, "meta", "metadata")))
    recorded = read_recorded(path, format=meta.get("format"))
    if recorded is not None:  # a damaged array raises ChecksumMismatchError, naming it
        verify(restored, recorded)
    for key in where:
        restored = restored[key]
    return restored
