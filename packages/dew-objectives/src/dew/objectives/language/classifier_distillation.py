"""Classifier distillation: Hinton soft targets for any model that outputs logits.

Per example, with the student's logits ``z_S`` and the frozen teacher's ``z_T``
(``[classes]``, or ``[..., classes]`` per position or pixel), the loss is the one of
:mod:`dew.objectives.language.distillation` (Hinton, Vinyals, Dean 2015, arXiv 1503.02531;
the generalized JSD of GKD between the ends):

    loss = (1 - alpha) T^2 D_beta(softmax(z_T / T), softmax(z_S / T)) + alpha CE(z_S, y)

``beta = 0`` is Hinton's ``KL(p_T || p_S)``; the ``T^2`` keeps the soft targets'
gradient the size of the hard label's as ``T`` changes. Defaults: Tunix's
``LogitStrategy`` (T = 2, alpha = 0.5). A :class:`~dew.objectives.Weighted` mean
over the examples (padded validation rows never count), float32 whatever the
models' dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import IDS, BatchField
from dew.objectives.contract.objective import (
    Objective,
    Role,
    Step,
    set_canonical,
    with_initial_values,
)
from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.divergences import (
    check_beta,
    check_fraction,
    check_temperature,
    distillation_losses,
)

__all__ = ["ClassifierDistillationObjective"]


@registry.register("classifier_distillation")
@dataclasses.dataclass(frozen=True, eq=False)
class ClassifierDistillationObjective(Objective):
    """A classifier (any logits model) distilled from a frozen teacher.

    student: the trained module, ``apply(variables, batch[input_key]) -> [rows, ...,
      classes]`` logits.
    teacher: the teacher's module, the same call and number of classes; another size
      or architecture is fine. None = the student's architecture.
    teacher_params: the teacher's weights (a frozen role, ``variables['teacher']``).
      None with ``alpha=1``: no teacher, the hard labels alone (plain supervised
      training, how a teacher of your own is trained; ``divergence`` is then 0 and
      ``agreement`` 1).
    beta: 0 = Hinton's forward KL, 1 = reverse KL, between them ``D_beta``.
    temperature: > 0, on both models' logits; the divergence is multiplied by ``T^2``.
    alpha: in ``[0, 1]``, the weight of the hard-label cross-entropy (at T = 1).
    input_key: the batch key of the models' input (images, features).
    label_key: the batch key of int labels ``[rows, ...]``; None = no labels (alpha 0).
    init_params: start the student from these weights; None = a fresh init.

    Metrics: ``divergence`` (no ``T^2``), ``agreement`` (both argmaxes agree) and,
    with labels, ``nll``, ``teacher_nll`` and ``accuracy`` (the student's argmax).
    """

    student: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    teacher: Any = None
    teacher_params: Any = None
    beta: float = 0.0
    temperature: float = 2.0
    alpha: float = 0.5
    input_key: str = "image"
    label_key: str | None = "label"
    init_params: Any = None

    headline_metrics = ("divergence",)

    def __post_init__(self):
        what = type(self).__name__
        set_canonical(
            self,
            beta=check_beta(self.beta),
            temperature=check_temperature(self.temperature),
            alpha=check_fraction("alpha", self.alpha, "the weight of the hard-label cross-entropy"),
        )
        if self.alpha and self.label_key is None:
            raise ValueError(
                f"{what}(alpha={self.alpha}) weighs a hard-label cross-entropy but "
                f"label_key=None; give the labels' batch key or alpha=0"
            )
        if self.teacher_params is None and self.alpha != 1:
            raise ValueError(
                f"{what}(alpha={self.alpha}) needs the teacher's weights: pass "
                f"teacher_params=, or alpha=1 to train on the hard labels alone (no teacher)"
            )

    @property
    def model(self):
        """The trained model: the student."""
        return self.student

    @property
    def teacher_module(self):
        """The teacher's module: ``teacher``, or the student's architecture."""
        return self.student if self.teacher is None else self.teacher

    @property
    def has_teacher(self) -> bool:
        """False under ``alpha=1`` without ``teacher_params``: hard labels alone."""
        return self.teacher_params is not None

    def roles(self):
        policy = Role(name="policy", module=self.student)
        if not self.has_teacher:
            return (policy,)
        return (policy, Role(name="teacher", module=self.teacher_module, trained=False))

    def batch_fields(self):
        """The models' input (any row shape: the models state theirs, and ``init`` reads
        it from the data's spec) and, with ``alpha``, the integer labels."""
        fields = [BatchField(self.input_key, None, ("bool", "integer", "floating", "bfloat16"))]
        if self.label_key is not None:
            fields.append(BatchField(self.label_key, (), IDS, required=bool(self.alpha)))
        return tuple(fields)

    def init(self, key, spec=None):
        if spec is None or self.input_key not in spec:
            raise ValueError(
                f"{type(self).__name__}.init needs the data's spec with {self.input_key!r} "
                f"(the input's shape per row): use a reader's Dataset or pass spec="
            )
        field = spec[self.input_key]
        dtype = getattr(field, "dtype", np.float32)
        x = jnp.zeros((1, *tuple(field.shape)), dtype)
        params = self.student.init(key, x)["params"]
        if self.init_params is not None:
            params = with_initial_values(params, self.init_params, what="init_params")
        if not self.has_teacher:
            return {"params": {"policy": params}}
        fresh = jax.eval_shape(lambda: self.teacher_module.init(key, x))["params"]
        teacher = with_initial_values(fresh, self.teacher_params, what="the teacher's weights")
        return {"params": {"policy": params}, "teacher": {"params": teacher}}

    def _terms(self, variables, batch):
        x = batch[self.input_key]
        zs = self.student.apply({"params": variables["params"]["policy"]}, x)
        if self.has_teacher:
            teacher = jax.lax.stop_gradient(variables["teacher"]["params"])
            zt = self.teacher_module.apply({"params": teacher}, x)
        else:  # hard labels alone: the soft-target terms are 0
            zt = jax.lax.stop_gradient(zs)
        labels = None if self.label_key not in batch else batch[self.label_key]
        terms = distillation_losses(
            zs, zt, labels, beta=self.beta, temperature=self.temperature
        )  # each [rows, ...]
        if labels is not None:
            terms["accuracy"] = (jnp.argmax(zs, axis=-1) == labels).astype(jnp.float32)
        weights = jnp.ones(terms["divergence"].shape, jnp.float32)
        if "example_mask" in batch:  # padded rows of a last validation batch
            mask = batch["example_mask"].reshape((-1,) + (1,) * (weights.ndim - 1))
            weights = weights * mask.astype(jnp.float32)
        return terms, weights

    def loss(self, variables, batch, step: Step):
        terms, weights = self._terms(variables, batch)
        per_example = (1.0 - self.alpha) * self.temperature**2 * terms["divergence"]
        if self.alpha:
            per_example = per_example + self.alpha * terms["nll"]
        metrics = {k: Weighted.mean(v, weights) for k, v in terms.items()}
        return Weighted.mean(per_example, weights), metrics

    def evaluate(self, variables, batch, step: Step):
        terms, weights = self._terms(variables, batch)
        return {k: Weighted.mean(v, weights) for k, v in terms.items()}

    def export(self, variables):
        """The student as a :class:`dew.sampling.Pretrained` (``save`` writes it)."""
        from dew.sampling import Pretrained

        return Pretrained(model=self.student, params=variables["params"]["policy"])
