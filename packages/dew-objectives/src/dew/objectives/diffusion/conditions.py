"""The conditions of image and video diffusion: what the denoiser reads besides
``x_t`` and ``t``, and the null condition that classifier-free guidance needs.

``batch['label'] int32 [batch]`` (the model's ``num_classes``; ``num_classes`` itself
is the null class) and/or ``batch['context'] [batch, tokens, context_features]`` text
embeddings (optional ``batch['context_mask'] [batch, tokens]``), made by a frozen or a
trained text encoder (:class:`~dew.objectives.cores.conditioning.TextConditioning`).
With probability ``cond_dropout`` per example the condition is replaced by the null
one (Ho & Salimans 2022): the label by the null class, the context by
``null_context`` (default zeros) with its mask all ones; label and context of a row
drop together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract.batch import IDS, BatchField
from dew.objectives.cores.conditioning import TextConditioning


def check_guidance(guidance: float, *, cond_dropout: float, conditioned: bool) -> None:
    """Raise on a guidance scale the model cannot follow: one other than 1 needs the
    unconditional model (trained by ``cond_dropout > 0``) of a ``conditioned`` one."""
    if guidance != 1.0 and cond_dropout == 0.0:
        raise ValueError(
            f"guidance {guidance} needs the unconditional model, which is trained only "
            f"with condition dropout; this objective has cond_dropout=0: train with "
            f"cond_dropout > 0 (e.g. 0.1) or sample with guidance=1.0"
        )
    if guidance != 1.0 and not conditioned:
        raise ValueError(
            f"guidance {guidance} needs a conditioned model (num_classes or "
            f"context_features); this one is unconditional: use guidance=1.0"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ImageConditions:
    """The denoiser's ``label`` / ``context`` / ``context_mask`` keywords of a batch
    (module docstring); call it on a batch.

    num_classes: the model's class labels (label ``num_classes`` = null; 0 = none).
    context_features: the width of the text contexts it reads (0 = none).
    cond_dropout: probability per example of the null condition in training.
    null_context: ``[tokens, context_features]`` of the null prompt; None = zeros.
    text: the text-encoder route of a text-conditioned model.
    """

    num_classes: int
    context_features: int
    cond_dropout: float
    null_context: Any = None
    text: TextConditioning

    def __call__(self, batch, drop_key: jax.Array | None) -> dict[str, jax.Array]:
        """The model's keywords, with condition dropout when ``drop_key`` is given (one
        key per row, or one key for the batch)."""
        out = {}
        drop = None
        conditioned = self.num_classes or self.context_features
        if drop_key is not None and self.cond_dropout > 0 and conditioned:
            if drop_key.shape:  # one key per row: the same draw at any accumulation
                drop = jax.vmap(lambda k: jax.random.bernoulli(k, self.cond_dropout))(drop_key)
            else:
                rows = batch["label" if self.num_classes else "context"].shape[0]
                drop = jax.random.bernoulli(drop_key, self.cond_dropout, (rows,))
        if self.num_classes:
            label = jnp.asarray(batch["label"], jnp.int32)
            out["label"] = label if drop is None else jnp.where(drop, self.num_classes, label)
        if self.context_features:
            context = jnp.asarray(batch["context"], jnp.float32)
            mask = batch.get("context_mask")
            if drop is not None:
                null = jnp.broadcast_to(self.null_like(context), context.shape)
                context = jnp.where(drop[:, None, None], null, context)
                if mask is not None:
                    mask = jnp.where(drop[:, None], True, jnp.asarray(mask, bool))
            out["context"] = context
            if mask is not None:
                out["context_mask"] = jnp.asarray(mask, bool)
        return out

    def null_like(self, context: jax.Array) -> jax.Array:
        """The null context ``[tokens, features]`` in ``context``'s dtype."""
        if self.null_context is None:
            return jnp.zeros(context.shape[1:], context.dtype)
        return jnp.asarray(self.null_context, context.dtype)

    def dummy(self, rows: int, tokens: int) -> dict[str, jax.Array]:
        """Zero conditions of ``rows`` rows (``tokens`` context tokens), to init with."""
        out = {}
        if self.num_classes:
            out["label"] = jnp.zeros((rows,), jnp.int32)
        if self.context_features:
            out["context"] = jnp.zeros((rows, tokens, self.context_features), jnp.float32)
        return out

    def fields(self) -> tuple[BatchField, ...]:
        """``label`` (required by a class-conditional model) and the text fields."""
        label = BatchField(
            "label",
            (),
            IDS,
            required=bool(self.num_classes),
            note=f"class-conditional, num_classes={self.num_classes}" if self.num_classes else "",
        )
        return (label, *self.text.text_fields())

    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """Label values in ``0..num_classes-1`` and the text batch's values."""
        if self.num_classes:
            label = np.asarray(batch["label"])
            if label.size and (label.min() < 0 or label.max() >= self.num_classes):
                raise ValueError(
                    f"batch['label'] holds {label.min()}..{label.max()}, the model has "
                    f"num_classes={self.num_classes} (labels 0..{self.num_classes - 1}; "
                    f"{self.num_classes} is the null class): remap the labels or build the model "
                    f"with more classes"
                )
        if self.context_features:
            self.text.check_text_batch(batch)
