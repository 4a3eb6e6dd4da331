"""What a checkpoint records besides the state (its ``meta`` item): each role's
registry name, config and relations, whether the run keeps and reads a moving
average, the batch size. ``fit`` writes it; ``load_model`` and a resumed run read it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dew.nn.lora import base_module, lora_of
from dew.train._programs import Programs
from dew.train._roles import evaluates_averaged, keeps_average, relations_record


def checkpoint_meta(programs: Programs, batch: int) -> dict:
    """The meta of ``programs``' run over data batches of ``batch`` rows.

    averaged: the state keeps a moving average (``TrainState.averaged``).
    evaluate_averaged: evaluation, previews and exports read it
      (``TrainState.variables()``'s default), so ``load_model`` returns it by default.
    """
    objective, roles = programs.objective, programs.roles
    meta: dict[str, Any] = {
        "averaged": keeps_average(objective, roles),
        "evaluate_averaged": evaluates_averaged(objective, roles),
        "batch": batch,
        "prepared_updates": programs.per_batch,
    }
    records = {}
    for role in roles:
        records[role.name] = {
            "trained": role.trained,
            **relations_record(role),
            **_model_record(base_module(role.module)),
        }
        if lora_of(role.module) is not None:
            records[role.name]["lora"] = dataclasses.asdict(lora_of(role.module))
    meta["roles"] = records
    trained = [r for r in roles if r.trained]
    first = records[trained[0].name] if trained else {"model": None}
    meta["model"] = first.get("model")
    if "model_note" in first:
        meta["model_note"] = first["model_note"]
    return meta


def first_trained_record(roles) -> dict | None:
    """The first trained role's ``{"name", "config"}`` (a checkpoint's ``model``)."""
    trained = [r for r in roles if r.trained]
    return _model_record(base_module(trained[0].module)).get("model") if trained else None


def _model_record(module) -> dict:
    from dew.nn import models

    try:
        name, config = models.config_of(module)
        json.dumps(config)
    except (ValueError, TypeError) as error:
        return {"model": None, "model_note": str(error)}
    return {"model": {"name": name, "config": config}}
