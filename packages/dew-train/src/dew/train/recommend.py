"""The fastest remat policy x microbatch setting whose training step fits one
device, found by compiling candidates with :func:`dew.train.plan`.

Ranking (MaxText's advice): recomputation costs compute on every step, while
microbatches (gradient accumulation) only make the matrix products smaller,
so the setting that recomputes least wins, then the one with the fewest
microbatches. Policies are tried in :func:`policy_order` (:data:`REMAT_POLICIES`
order, fastest first, with the models' own default ahead where it recomputes:
a scanned stack on a TPU); for each, the most microbatches first (one compile
says whether the policy can fit at all), then from the fewest up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import optax

from dew.nn.backbones import layer_stack_of
from dew.objectives import Objective
from dew.train.memory import StepDoesNotFit, device_memory_bytes, format_bytes
from dew.train.mesh import DEFAULT_RULES, MeshSpec, Rules, data_parallel_size
from dew.train.plan import Plan, plan

REMAT_POLICIES = ("none", "save_dot_except_mlp", "save_qkv_proj", "minimal", "full")
"""Candidate remat policies (MaxText's names), fastest first: ``none`` keeps every
activation, ``full`` recomputes each layer's forward in the backward pass."""


def policy_order(objective: Objective) -> tuple[str, ...]:
    """:data:`REMAT_POLICIES`, with the default of the objective's models first where
    that default recomputes (:func:`dew.nn.stack.default_remat_policy`: ``'minimal'``
    for a scanned stack on a TPU). There the scan's stacked residuals cost more than
    the recomputation: the 218M GPT-2 of docs/performance.md at seq 1024, batch 8 on
    a v5e took 112.9 ms a step with ``'minimal'`` against 122.6 ms keeping
    everything, 120.0 with ``'save_dot_except_mlp'`` and 122.3 with
    ``'save_qkv_proj'``."""
    first = []
    for module in _models(objective).values():
        stack = layer_stack_of(module)
        if stack is None:
            continue
        default = dataclasses.replace(stack, remat_policy=None, use_remat=False).remat_name
        if default != "none" and default not in first:
            first.append(default)
    return (*first, *(p for p in REMAT_POLICIES if p not in first))


LEGACY = {"none": False, "full": True}
"""``use_remat`` for a policy of a backbone that does not take named policies."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recommendation:
    """The fastest setting that fits, and what was tried.

    remat_policy: the policy name (one of :data:`REMAT_POLICIES`), or None when
      nothing fits.
    accumulate: microbatches per step (``Trainer(accumulate=)``); None when nothing fits.
    plan: the :class:`Plan` of that setting (None when nothing fits).
    device_memory_bytes: the bytes one device may hold.
    tried: ``(policy, accumulate, peak bytes or None when XLA refused to compile)``
      in the order compiled.
    skipped: policies the objective's models do not take, with why.
    model_settings: the recommended setting as the models' fields:
      ``{'remat_policy': name}``, or ``{'use_remat': bool}`` for a model that
      takes no named policies; empty when nothing fits.
    """

    remat_policy: str | None
    accumulate: int | None
    plan: Plan | None
    device_memory_bytes: int
    tried: tuple[tuple[str, int, int | None], ...] = ()
    skipped: tuple[str, ...] = ()
    model_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def __str__(self) -> str:
        limit = format_bytes(self.device_memory_bytes)
        lines = []
        if self.plan is None:
            lines.append(
                f"nothing fits {limit} per device: use a smaller batch or more devices "
                f"(MeshSpec(fsdp=N))"
            )
        else:
            lines.append(
                f"recommended: remat_policy={self.remat_policy!r}, accumulate={self.accumulate} "
                f"(peak {format_bytes(self.plan.peak_bytes)} of {limit} per device)"
            )
        for policy, accumulate, peak in self.tried:
            shown = "XLA refused: out of memory" if peak is None else format_bytes(peak)
            verdict = "fits" if peak is not None and peak <= self.device_memory_bytes else "no"
            lines.append(f"  {policy:<22} accumulate={accumulate:<3} {shown:>12}  {verdict}")
        lines += [f"  skipped {s}" for s in self.skipped]
        return "\n".join(lines)


def with_remat_policy(objective: Objective, policy: str) -> Objective:
    """``objective`` with every model it holds (a dataclass field that is a linen
    module with ``remat_policy`` or ``use_remat``) cloned to ``policy``: as
    ``remat_policy=policy`` (for a backbone that takes named policies; others
    fail when traced), or as ``use_remat`` (:data:`LEGACY`) with ``legacy=True``."""
    return _replace_models(objective, lambda m: _named(m, policy))


def _with_legacy_remat(objective: Objective, policy: str) -> Objective:
    return _replace_models(
        objective, lambda m: m.clone(use_remat=LEGACY[policy], remat_policy=None)
    )


def _named(module: nn.Module, policy: str) -> nn.Module:
    if policy in LEGACY and "use_remat" in _fields(module):
        # both spellings at once: a backbone whose use_remat stays beside named policies
        return module.clone(remat_policy=policy, use_remat=LEGACY[policy])
    return module.clone(remat_policy=policy)


def _models(objective: Objective) -> dict[str, nn.Module]:
    """The objective's models by field: linen modules with a ``remat_policy`` or
    ``use_remat`` field."""
    models = {}
    for field in dataclasses.fields(objective):
        value = getattr(objective, field.name, None)
        if (
            field.init
            and isinstance(value, nn.Module)
            and _fields(value) & {"remat_policy", "use_remat"}
        ):
            models[field.name] = value
    return models


def _replace_models(objective: Objective, clone) -> Objective:
    changes = {name: clone(module) for name, module in _models(objective).items()}
    if not changes:
        raise ValueError(
            f"{type(objective).__name__} holds no model with a remat_policy or use_remat "
            f"field to recommend a setting for"
        )
    return dataclasses.replace(objective, **changes)


def _fields(module) -> set[str]:
    return {f.name for f in dataclasses.fields(module)}


def accumulate_choices(rows: int, data_parallel: int, limit: int = 64) -> tuple[int, ...]:
    """Powers of two up to ``limit`` that split ``rows`` evenly over the data-parallel
    devices."""
    out, k = [], 1
    while k <= limit and rows % (k * data_parallel) == 0:
        out.append(k)
        k *= 2
    return tuple(out)


def recommend(
    objective: Objective,
    optimizer: optax.GradientTransformation,
    *,
    mesh: MeshSpec,
    batch: Mapping[str, jax.ShapeDtypeStruct | tuple[tuple[int, ...], Any]],
    rules: Rules | None = None,
    device_memory_bytes: int | str | None = None,
    policies: Sequence[str] | None = None,
    accumulates: Sequence[int] | None = None,
) -> Recommendation:
    """The fastest (remat policy, accumulate) whose compiled step fits one device
    (``Plan.peak_bytes <= device_memory_bytes``), by the module's ranking.

    device_memory_bytes: bytes per device; None = the device's own
      (:func:`dew.train.memory.device_memory_bytes`; a CPU needs it given).
    policies: candidate names, fastest first; None = :func:`policy_order`. A model
      without named policies (only ``use_remat``) gets ``'none'`` and ``'full'``;
      the others are skipped.
    accumulates: candidate microbatch counts; None = powers of two that divide the
      batch over the data-parallel devices (up to 64).
    """
    rules = DEFAULT_RULES if rules is None else rules
    policies = policy_order(objective) if policies is None else policies
    limit = _limit(mesh, device_memory_bytes)
    shapes = {
        k: v if isinstance(v, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(*v)
        for k, v in batch.items()
    }
    if accumulates is None:
        rows = next(iter(shapes.values())).shape[0]
        dp = data_parallel_size(mesh.make(), rules)
        accumulates = (1,) if objective.has_prepare else accumulate_choices(rows, dp)
    accumulates = sorted(accumulates)
    tried: list[tuple[str, int, int | None]] = []
    skipped: list[str] = []

    def attempt(candidate, policy, accumulate):
        try:
            result = plan(
                candidate,
                optimizer,
                mesh=mesh,
                batch=shapes,
                rules=rules,
                accumulate=accumulate,
                device_memory_bytes=limit,
            )
        except StepDoesNotFit:
            tried.append((policy, accumulate, None))
            return None
        tried.append((policy, accumulate, result.peak_bytes))
        return result if result.fits else None

    for policy in policies:
        candidate = _candidate(objective, policy, optimizer, mesh, shapes, rules, skipped)
        if candidate is None:
            continue
        candidate, settings = candidate
        most = attempt(candidate, policy, accumulates[-1])
        if most is None:
            continue  # not even with the most microbatches
        for accumulate in accumulates[:-1]:
            found = attempt(candidate, policy, accumulate)
            if found is not None:
                return _found(policy, accumulate, found, limit, tried, skipped, settings)
        return _found(policy, accumulates[-1], most, limit, tried, skipped, settings)
    return Recommendation(
        remat_policy=None,
        accumulate=None,
        plan=None,
        device_memory_bytes=limit,
        tried=tuple(tried),
        skipped=tuple(skipped),
    )


def _found(policy, accumulate, found, limit, tried, skipped, settings) -> Recommendation:
    return Recommendation(
        model_settings=settings,
        remat_policy=policy,
        accumulate=accumulate,
        plan=found,
        device_memory_bytes=limit,
        tried=tuple(tried),
        skipped=tuple(skipped),
    )


def _candidate(objective, policy, optimizer, mesh, shapes, rules, skipped):
    """``(objective under policy, its models' settings)``, or None (noted in
    ``skipped``) when its models take neither the named policy nor, for ``none`` /
    ``full``, ``use_remat``."""
    try:  # building the model or tracing its initialisation validates the policy name
        named = with_remat_policy(objective, policy)
        plan_shapes_only(named, optimizer, mesh, shapes, rules)
        return named, {"remat_policy": policy}
    except ValueError as error:
        if "remat_policy" not in str(error):
            raise
        if policy not in LEGACY:
            reason = str(error).split(";")[0]
            skipped.append(f"{policy!r}: the model takes no named remat policies ({reason})")
            return None
        return _with_legacy_remat(objective, policy), {"use_remat": LEGACY[policy]}


def plan_shapes_only(objective, optimizer, mesh, shapes, rules) -> None:
    """Trace the objective's initialisation on abstract shapes (nothing compiled):
    raises what its models raise for their settings (an unknown remat policy)."""
    from dew.train._programs import Programs
    from dew.train.trainer import as_optax

    programs = Programs(objective=objective, optimizer=as_optax(optimizer), mesh=mesh, rules=rules)
    programs.state_shardings(None, key=jax.eval_shape(_any_key))


def _any_key() -> jax.Array:
    return jax.random.key(0)  # traced only: its shape and dtype


def _limit(mesh: MeshSpec, override) -> int:
    limit = device_memory_bytes(mesh.make().devices.flat, override)
    if limit is None:
        raise ValueError(
            "no device memory limit known for this backend (a CPU); give "
            "device_memory_bytes= (e.g. '16GiB') or set DEW_DEVICE_MEMORY"
        )
    return limit
