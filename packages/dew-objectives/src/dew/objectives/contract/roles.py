"""Models by role: Dew's vocabulary of role names (:data:`ROLE_NAMES`), :class:`Role`
with its declared relations (``initial_from``, ``averages``), their check
(:func:`check_roles`), and how a role starts from given weights
(:func:`with_initial_values`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract.step import EMA

ROLE_NAMES: dict[str, str] = {
    "policy": "the model an objective trains to produce its outputs: the language model "
    "(LM, DPO, GRPO, PPO, MDLM, BD3-LM), the denoiser (diffusion, Flow-GRPO), the student "
    "(distillation)",
    "value": "a value model or head trained beside the policy (PPO)",
    "reference": "a frozen copy of the policy the loss keeps close to (DPO, GRPO, PPO, "
    "Flow-GRPO): Role(initial_from='policy') when it is the initial policy",
    "encoder": "a trained encoder (JEPA's context encoder)",
    "predictor": "a trained predictor reading the encoder's features (JEPA)",
    "target": "a moving average of a trained role the loss reads (JEPA's target encoder): "
    "Role(averages='encoder')",
    "teacher": "a frozen model whose outputs a student learns (distillation)",
    "text_encoder": "the encoder of a text-conditioned model's prompts (diffusion), frozen "
    "or trained",
    "reward": "a frozen reward model",
}
"""Dew's one vocabulary of role names: every family names its models from it, so a
checkpoint's roles and ``load_model(directory, role=...)`` read the same across
families. An objective of your own may use other names (any identifier)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Role:
    """One model an objective uses, by the part it plays.

    name: the role, from :data:`ROLE_NAMES` (``"policy"``, ``"value"``,
      ``"reference"``, ``"encoder"``, ``"predictor"``, ``"target"``, ``"teacher"``,
      ``"text_encoder"``) for Dew's families; unique within an objective.
    module: the ``flax.linen.Module``.
    trained: True = its parameters are optimized (``TrainState.params_by_role[name]``);
      False = frozen: kept in ``TrainState.frozen[name]``, checkpointed, never in
      the optimizer state. A frozen role's variables come from the objective's
      ``init`` (given weights through the objective's own argument, e.g.
      ``GRPOObjective(reference=...)`` or a distillation teacher's), or from a
      relation below.
    initial_from: a declared relation: this frozen role starts as the initial
      weights of the named role (a reference policy: ``initial_from="policy"``).
      The trainer fills ``variables[name]`` from that role when ``init`` does not
      return it; under LoRA, when the named role trains adapters, the role is the
      base without adapters, stored once (:mod:`dew.train.adapters`).
    averages: a declared relation: this role is the exponential moving average of
      the named trained role (JEPA's ``target`` of ``encoder``), with ``ema`` as its
      decay schedule (None: the objective's ``ema``). It is never optimized: the
      trainer keeps it in ``TrainState.averaged_by_role`` (at the trained role) and
      passes it to the loss as ``variables[name]['params']``, without gradient.
    ema: an averaged role's :class:`EMA` (decay, warm-up, ``include`` over the
      trained role's own parameter paths).

    A relation naming a role the objective does not declare, or relations that
    form a cycle, raise ValueError before anything is compiled
    (:func:`check_roles`).

    A checkpoint records each role's registry name and config
    (``dew.nn.models.config_of``) and its relations, so
    ``load_model(directory, role=...)`` rebuilds any of them, averaged roles and
    LoRA bases included.
    """

    name: str
    module: Any
    trained: bool = True
    initial_from: str | None = None
    averages: str | None = None
    ema: EMA | None = None

    def __post_init__(self):
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"a role name must be an identifier, got {self.name!r}")
        if self.initial_from is not None and self.averages is not None:
            raise ValueError(
                f"role {self.name!r} declares initial_from={self.initial_from!r} and "
                f"averages={self.averages!r}; an averaged role starts as the role it averages, "
                f"so declare averages= only"
            )
        for relation in ("initial_from", "averages"):
            value = getattr(self, relation)
            if value is None:
                continue
            if self.trained:
                raise ValueError(
                    f"Role({self.name!r}, {relation}={value!r}) is trained; a role "
                    f"{'initialised from' if relation == 'initial_from' else 'averaging'} "
                    f"another is never optimized: pass trained=False"
                )
            if value == self.name:
                raise ValueError(
                    f"Role({self.name!r}, {relation}={value!r}) names itself; name the "
                    f"trained role it comes from"
                )
        if self.ema is not None and self.averages is None:
            raise ValueError(
                f"Role({self.name!r}, ema=...) is not an averaged role; declare the trained "
                f"role it averages with averages='<role>', or set the objective's ema"
            )
        if self.ema is not None and not isinstance(self.ema, EMA):
            raise TypeError(
                f"Role({self.name!r}).ema must be a dew.objectives.EMA, got "
                f"{type(self.ema).__name__}"
            )


def check_roles(objective) -> tuple[Role, ...]:
    """``objective.roles()``, checked: Role objects with unique names, at least one
    trained, and relations (``initial_from``, ``averages``) that name declared roles
    and form no cycle. Raises TypeError / ValueError naming the role and what to do;
    the trainer calls it before anything is compiled."""
    what = type(objective).__name__
    if getattr(objective, "uses_averaged", False):
        raise ValueError(
            f"{what}.uses_averaged is gone: declare the moving average as a role, "
            f"Role(name='target', module=..., trained=False, averages='<trained role>', "
            f"ema=EMA(...)), and read variables['target']['params'] in the loss"
        )
    roles = tuple(objective.roles())
    seen: dict[str, int] = {}
    for role in roles:
        if not isinstance(role, Role):
            raise TypeError(
                f"{what}.roles() must return dew.objectives.Role objects, got {type(role).__name__}"
            )
        seen[role.name] = seen.get(role.name, 0) + 1
    names = [r.name for r in roles]
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(
            f"{what} declares role name(s) {twice} more than once (roles: {names}); give "
            f"every role its own name"
        )
    if not any(role.trained for role in roles):
        raise ValueError(
            f"{what} declares no trained role (roles: {names}); mark at least one "
            f"Role(trained=True)"
        )
    by_name = {r.name: r for r in roles}
    for role in roles:
        for relation in ("initial_from", "averages"):
            other = getattr(role, relation)
            if other is not None and other not in by_name:
                raise ValueError(
                    f"{what}: Role({role.name!r}, {relation}={other!r}) names a role the "
                    f"objective does not declare (roles: {names}); name one of them"
                )
        if role.averages is not None:
            if not by_name[role.averages].trained:
                raise ValueError(
                    f"{what}: Role({role.name!r}, averages={role.averages!r}) averages a "
                    f"frozen role, which never changes; name a trained role "
                    f"({[r.name for r in roles if r.trained]})"
                )
            if role.ema is None and getattr(objective, "ema", None) is None:
                raise ValueError(
                    f"{what}: Role({role.name!r}, averages={role.averages!r}) has no decay: "
                    f"pass Role(..., ema=EMA(decay=...)) or set the objective's ema"
                )
    for role in roles:  # a chain of initial_from ends at a trained or averaged role
        chain = [role.name]
        current = role
        while current.initial_from is not None:
            current = by_name[current.initial_from]
            if current.name in chain:
                cycle = " -> ".join([*chain[chain.index(current.name) :], current.name])
                raise ValueError(
                    f"{what}: the roles' initial_from relations form a cycle ({cycle}), so "
                    f"none of them has weights to start from; let one of them start from a "
                    f"trained role or from its own weights"
                )
            chain.append(current.name)
    averaged: dict[str, Role] = {}
    for role in roles:
        if role.averages is not None:
            first = averaged.setdefault(role.averages, role)
            if first.ema != role.ema:
                raise ValueError(
                    f"{what}: roles {first.name!r} and {role.name!r} both average "
                    f"{role.averages!r} with different EMAs; the trainer keeps one moving "
                    f"average per trained role: give both the same ema"
                )
    return roles


def initial_source(roles: tuple[Role, ...], name: str) -> Role:
    """The role whose initial weights role ``name`` starts from: ``name`` itself, or
    the end of its ``initial_from`` chain (a trained role, an averaged role's trained
    role, or a frozen role with weights of its own)."""
    by_name = {r.name: r for r in roles}
    role = by_name[name]
    while role.initial_from is not None:
        role = by_name[role.initial_from]
    if role.averages is not None:
        role = by_name[role.averages]
    return role


def nn_unbox(tree):
    import flax.linen as nn

    return nn.unbox(tree)


def check_same_shapes(expected, given, *, what: str) -> None:
    """Raise ValueError naming every path whose presence or shape differs."""
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in _leaves(expected)}
    got = {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in _leaves(given)}
    problems = [
        f"{k}: given {got[k]}, module has {v}" for k, v in want.items() if k in got and got[k] != v
    ]
    problems += [f"{k}: missing (module has {v})" for k, v in want.items() if k not in got]
    problems += [f"{k}: not in the module (given {v})" for k, v in got.items() if k not in want]
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ValueError(
            f"{what}: the weights do not fit the module ({shown}); load weights saved for "
            f"this architecture and config"
        )


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def with_initial_values(boxed, values, *, what: str = "init_params"):
    """A fresh init's parameter tree ``boxed`` with ``values`` at its leaves (the
    logical-axis boxes kept, each value cast to the fresh leaf's dtype): how an
    objective starts from ``init_params`` (a ``Pretrained`` load).

    Under LoRA (a model from ``dew.nn.lora.LoRA.apply``) the fresh tree also holds the
    adapters; ``values`` (the base weights) need not: the adapters missing from
    it keep their fresh initialisation (``B = 0``, so the model starts as the
    base). Any other missing, extra or misshapen path is a ValueError naming it.
    """
    import flax.linen as nn

    from dew.nn.lora import merge, split

    values = nn.unbox(values["params"] if "params" in values else values)
    fresh_base, fresh_adapters = split(boxed)
    given_base, given_adapters = split(values)
    if given_adapters:  # a checkpoint's adapters too: all of them, checked below
        fresh_base, given_base = boxed, values
        fresh_adapters = {}
    check_same_shapes(nn.unbox(fresh_base), given_base, what=what)

    def fill(box, value):
        if isinstance(box, nn.meta.AxisMetadata):
            return box.replace_boxed(jnp.asarray(value, box.unbox().dtype))
        return jnp.asarray(value, box.dtype)

    filled = jax.tree.map(
        fill, fresh_base, given_base, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )
    return merge(filled, fresh_adapters) if fresh_adapters else filled
