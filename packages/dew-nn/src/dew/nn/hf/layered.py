""":class:`LayeredFormat`: a format whose tensors are one :class:`~dew.nn.hf.layout.Layout`.

Every family Dew reads (causal LMs, I-JEPA and V-JEPA 2 encoders, diffusers'
DiT) keeps its checkpoint as a few global tensors plus the same tensors per
layer, which :func:`~dew.nn.hf.layout.read_layout` and
:func:`~dew.nn.hf.layout.write_layout` map onto a Dew layer stack (scanned,
one ``[layers, ...]`` array per parameter, or ``layer_{i}``). This base class
holds that walk, the parameter check around it and the refusal of a model the
family cannot hold; a family says which options it needs
(:meth:`~LayeredFormat.requirements`), how its tensors are laid out
(:meth:`~LayeredFormat.layout`) and, through the hooks, what it reads or
writes outside the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from dew.nn.hf.format import as_module, check_params
from dew.nn.hf.layout import Layout, read_layout, write_layout


def full_width_heads(model) -> list[tuple[str, Any, bool]]:
    """The :meth:`LayeredFormat.requirements` of a format whose attention has one
    key/value head per query head, each ``emb_features // num_heads`` wide (ViT,
    I-JEPA, V-JEPA 2, DiT): the shared options ``num_kv_heads`` and ``head_dim``
    at their defaults."""
    return [
        (
            "num_kv_heads",
            f"None (= num_heads {model.num_heads})",
            model.kv_heads == model.num_heads,
        ),
        (
            "head_dim",
            f"None (= emb_features // num_heads = {model.emb_features // model.num_heads})",
            model.features_per_head * model.num_heads == model.emb_features,
        ),
    ]


class LayeredFormat:
    """Base of the formats whose tensors are one :class:`Layout` over a layer stack.

    Subclasses set ``family``, ``architecture`` and ``registry_name`` and
    implement :meth:`requirements` and :meth:`layout`; the hooks :meth:`after_read`,
    :meth:`before_write` and :meth:`after_write` default to nothing.
    """

    family: str
    architecture: str
    registry_name: str
    model_noun = "model"  # "this <noun>" in the refusal of an inexpressible model
    check_on_read = False  # refuse an inexpressible model before reading its tensors

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    def holder(self) -> str:
        """What the refusal says cannot hold the model (``'a llama checkpoint'``)."""
        return f"a {self.family} checkpoint"

    # --------------------------------------------------------------- family

    def requirements(self, model) -> list[tuple[str, Any, bool]]:
        """``(option, what the family needs, whether the model has it)`` per constrained option."""
        raise NotImplementedError

    def layout(self, model) -> Layout:
        """The checkpoint tensors of ``model``."""
        raise NotImplementedError

    def read_layout_of(self, model, tensors: Mapping[str, Any]) -> Layout:
        """The layout the checkpoint ``tensors`` are read with (by default :meth:`layout`;
        a family with two spellings of its tensor names picks one here)."""
        return self.layout(model)

    def after_read(self, flat: dict, tensors: Mapping[str, Any], model, where: str) -> None:
        """Complete or check ``flat`` (``{'/'-joined path: array}``) after the layout is read."""

    def before_write(self, flat: dict, model) -> None:
        """Complete ``flat`` before the layout is written."""

    def after_write(self, out: dict, flat: Mapping[str, Any], model) -> None:
        """Add to the checkpoint ``out`` what the layout does not write."""

    @staticmethod
    def layer_prefix(model):
        """Where the model keeps layer ``i``'s parameters, as its layer stack lays them
        out: ``layers`` (scanned, one ``[layers, ...]`` array) or ``layer_{i}``."""
        stack = model.layer_stack()
        return (lambda i: stack.name) if stack.use_scan else stack.layer_name

    # --------------------------------------------------------------- HFFormat

    def check_expressible(self, config) -> None:
        """Raise unless a checkpoint of this family can hold the model exactly."""
        model = as_module(config, self.registry_name)
        wrong = [(o, n) for o, n, ok in self.requirements(model) if not ok]
        if wrong:
            needs = "; ".join(f"{o}={n} (the model has {getattr(model, o)!r})" for o, n in wrong)
            raise ValueError(
                f"{self.holder} cannot hold this {self.model_noun}: {self.family} needs "
                f"{needs}. Save it with format='dew' instead"
            )

    def transformers_config(
        self, config, base: Mapping[str, Any] | None, dtype_name: str, *, drop: tuple = ()
    ) -> tuple[nn.Module, dict[str, Any]]:
        """``(model, the start of its transformers config.json)``: ``base`` without
        ``torch_dtype`` and the ``drop`` fields, naming the architecture, ``model_type`` and
        ``dtype``; raises first unless the family can hold the model."""
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
        out = dict(base or {})
        for key in ("torch_dtype", *drop):
            out.pop(key, None)
        out.update(architectures=[self.architecture], model_type=self.family, dtype=dtype_name)
        return model, out

    def params_from_hf(
        self, tensors: Mapping[str, Any], config, *, where: str = ""
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        if self.check_on_read:
            self.check_expressible(model)
        flat = read_layout(
            self.read_layout_of(model, tensors),
            tensors,
            num_layers=model.num_layers,
            stacked=model.layer_stack().use_scan,
            dtype=model.param_dtype,
            family=self.family,
            where=where,
            layer_prefix=self.layer_prefix(model),
        )
        self.after_read(flat, tensors, model, where)
        check_params(model, flat, self.family)
        return traverse_util.unflatten_dict(flat, sep="/")

    def params_to_hf(self, params, config) -> dict[str, np.ndarray]:
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
        flat = {
            k: np.asarray(jax.device_get(v))
            for k, v in traverse_util.flatten_dict(nn.meta.unbox(params), sep="/").items()
        }
        check_params(model, flat, self.family)
        self.before_write(flat, model)
        out = write_layout(
            self.layout(model),
            flat,
            num_layers=model.num_layers,
            stacked=model.layer_stack().use_scan,
            layer_prefix=self.layer_prefix(model),
        )
        self.after_write(out, flat, model)
        return out
