"""Declared role relations: bad declarations are refused when the Trainer is built
(before anything is traced or compiled), naming the role and what to do; a frozen
role declared ``initial_from`` the policy is filled by the trainer when ``init``
does not return it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.nn.testing import tiny_lm
from dew.objectives import EMA, Objective, Role
from dew.train import MeshSpec, Trainer

ONE = MeshSpec(data=1, devices=jax.devices()[:1])
MODEL = tiny_lm(max_seq_len=8)


@dataclasses.dataclass(eq=False)
class Declared(Objective):
    """A policy with the frozen and averaged roles ``extra`` declares."""

    extra: tuple = ()
    model: Any = MODEL
    ema: EMA | None = None

    def roles(self):
        return (Role(name="policy", module=self.model), *self.extra)

    def init(self, key):
        return {"params": {"policy": self.model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]}}

    def loss(self, variables, batch, step):
        return jnp.float32(0.0), {}


def trainer(*extra, **kw):
    return Trainer(Declared(extra=extra, **kw), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)


def frozen(name, **relation):
    return Role(name=name, module=MODEL, trained=False, **relation)


def test_a_relation_naming_a_missing_role_is_refused():
    with pytest.raises(
        ValueError,
        match=r"Role\('reference', initial_from='model'\) names a role the objective does not "
        r"declare \(roles: \['policy', 'reference'\]\); name one of them",
    ):
        trainer(frozen("reference", initial_from="model"))
    with pytest.raises(ValueError, match=r"Role\('target', averages='encoder'\) names a role"):
        trainer(frozen("target", averages="encoder", ema=EMA(decay=0.9)))


def test_a_cycle_of_relations_is_refused():
    with pytest.raises(
        ValueError,
        match=r"initial_from relations form a cycle \(reference -> teacher -> reference\), so "
        r"none of them has weights to start from; let one of them start from a trained role",
    ):
        trainer(
            frozen("reference", initial_from="teacher"), frozen("teacher", initial_from="reference")
        )


def test_other_bad_relations_are_named():
    with pytest.raises(ValueError, match=r"averages='reference'\) averages a frozen role"):
        trainer(
            frozen("reference", initial_from="policy"),
            frozen("target", averages="reference", ema=EMA(decay=0.9)),
        )
    with pytest.raises(ValueError, match=r"Role\('target', averages='policy'\) has no decay"):
        trainer(frozen("target", averages="policy"))
    with pytest.raises(ValueError, match=r"both average 'policy' with different EMAs"):
        trainer(
            frozen("target", averages="policy", ema=EMA(decay=0.9)),
            frozen("slow", averages="policy", ema=EMA(decay=0.99)),
        )
    with pytest.raises(ValueError, match=r"Role\('value', initial_from='policy'\) is trained"):
        Role(name="value", module=MODEL, initial_from="policy")
    with pytest.raises(ValueError, match=r"names itself"):
        frozen("reference", initial_from="reference")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'weights'"):
        frozen("reference", weights={"params": {}})  # gone: a frozen role's come from init

    class Legacy(Declared):
        uses_averaged = True

    with pytest.raises(ValueError, match=r"Legacy.uses_averaged is gone: declare .*averages="):
        Trainer(Legacy(), optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)


def test_the_trainer_fills_a_declared_initial_copy():
    """Without LoRA the reference is a copy of the initial policy, made by the trainer
    from the declaration (``init`` returned only ``params``); an undeclared frozen role
    that ``init`` leaves out is refused, naming it."""
    t = trainer(frozen("reference", initial_from="policy"))
    state = jax.device_get(t.init_state())
    jax.tree.map(np.testing.assert_array_equal, state.frozen["reference"]["params"], state.params)
    with pytest.raises(
        ValueError,
        match=r"Declared.init returned no variables for frozen role 'teacher'.*declare "
        r"Role\('teacher', initial_from='<role>'\)",
    ):
        trainer(frozen("teacher")).init_state()
