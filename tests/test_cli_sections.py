"""The recipe's mesh, checkpoints and trainer sections against the library classes
they configure (``MeshSpec``, ``Checkpoints``, ``Trainer`` / ``Trainer.fit`` /
``EMA``): each key is a parameter of its class with the same type, and the same
default unless listed here as the command's own; a parameter added to a class
fails here until the recipe has it (or it is listed as one the command sets)."""

import dataclasses
import inspect
import typing

from dew.cli import recipe
from dew.objectives import EMA
from dew.train import Checkpoints, MeshSpec, Trainer


def section(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default if f.default is not dataclasses.MISSING else None)
        for f in dataclasses.fields(cls)
    }


def parameters(fn, *, skip=()) -> dict:
    hints = typing.get_type_hints(fn, localns={"Objective": object})
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in ("self", *skip) or p.kind is p.VAR_KEYWORD:
            continue
        default = None if p.default is inspect.Parameter.empty else p.default
        out[name] = (hints.get(name), default)
    return out


def test_mesh_section_is_mesh_spec():
    spec = {
        f.name: (typing.get_type_hints(MeshSpec)[f.name], f.default)
        for f in dataclasses.fields(MeshSpec)
        if f.name != "devices"  # the command uses every device present
    }
    assert section(recipe.MeshSection) == spec


def test_checkpoints_section_is_checkpoints():
    # the command sets the directory; a recipe never resets or discards a run's state
    own = parameters(Checkpoints.__init__, skip=("directory", "reset_optimizer", "start_fresh"))
    assert section(recipe.CheckpointsSection) == own


def test_trainer_section_is_trainer_fit_and_ema():
    """Each key of ``trainer`` is a parameter of ``Trainer``, ``Trainer.fit`` or ``EMA``
    (``ema_*``) of the same type; the defaults that differ are the command's own."""
    trainer = parameters(Trainer.__init__)
    fit = parameters(Trainer.fit, skip=("data",))
    ema = {f"ema_{k}": v for k, v in parameters(EMA).items()}
    ema["ema"] = (float | None, None)  # the decay; None = the objective's own average
    own_defaults = {
        "log_every": 10,  # fit's is 100: a recipe's runs are short
        "ema_use_warmup": True,  # the families' EMA warms up (EMA's own default: False)
        "seed": 0,  # Trainer's key=jax.random.key(seed)
    }
    for name, (hint, default) in section(recipe.TrainerSection).items():
        if name == "seed":
            assert "key" in trainer and hint is int
            continue
        found = trainer.get(name) or fit.get(name) or ema.get(name)
        assert found is not None, f"trainer.{name} configures nothing in Trainer/fit/EMA"
        if name != "ema":
            assert found[0] == hint, (name, found[0], hint)
        assert default == own_defaults.get(name, found[1]), (name, default, found[1])
    # every cadence and count fit takes is in the recipe
    assert set(fit) <= set(section(recipe.TrainerSection)), set(fit)
