""":class:`CausalLMFormat`: what every causal-LM family shares.

A family that maps onto :class:`dew.nn.CausalTransformer` says how its
``config.json`` reads (:meth:`~CausalLMFormat.read_options`) and is written
(:meth:`~CausalLMFormat.write_config`), which options it can hold
(:meth:`~CausalLMFormat.requirements`) and how its tensors are laid out
(:meth:`~CausalLMFormat.layout`); this base class turns that into the four
conversions of :class:`~dew.nn.hf.HFFormat`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.format import as_module, check_params
from dew.nn.hf.layout import Layout, read_layout, write_layout


class CausalLMFormat:
    """Base of the families that load into ``CausalTransformer``.

    Subclasses set ``family`` and ``architecture`` and implement
    :meth:`read_options`, :meth:`requirements`, :meth:`write_config` and :meth:`layout`.
    """

    family: str
    architecture: str
    registry_name = "causal_transformer"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.family!r})"

    # --------------------------------------------------------------- family

    def read_options(self, fields: ConfigFields) -> dict[str, Any]:
        """``CausalTransformer`` options from the config's fields."""
        raise NotImplementedError

    def requirements(self, model) -> list[tuple[str, str, bool]]:
        """``(option, what the family needs, whether the model has it)`` per constrained option."""
        raise NotImplementedError

    def write_config(self, model, config: dict[str, Any]) -> None:
        """Set the family's fields of ``config`` from ``model``."""
        raise NotImplementedError

    def layout(self, model) -> Layout:
        """The checkpoint tensors of ``model``."""
        raise NotImplementedError

    @staticmethod
    def layer_prefix(model):
        """Where the model keeps layer ``i``'s parameters, as its layer stack lays them
        out: ``layers`` (scanned, one ``[layers, ...]`` array) or ``layer_{i}``."""
        stack = model.layer_stack()
        return (lambda i: stack.name) if stack.use_scan else stack.layer_name

    # --------------------------------------------------------------- HFFormat

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        options = self.read_options(fields)
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def check_expressible(self, config) -> None:
        """Raise unless a checkpoint of this family can hold the model exactly."""
        model = as_module(config, self.registry_name)
        wrong = [(o, n) for o, n, ok in self.requirements(model) if not ok]
        if wrong:
            needs = "; ".join(f"{o}={n} (the model has {getattr(model, o)!r})" for o, n in wrong)
            raise ValueError(
                f"a {self.family} checkpoint cannot hold this model: {self.family} needs "
                f"{needs}. Save it with format='dew' instead"
            )

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
        out = dict(base or {})
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype"):
            out.pop(key, None)  # rewritten below, in the form this version writes
        out.update(
            architectures=[self.architecture],
            model_type=self.family,
            dtype=dtype_name,
            vocab_size=model.vocab_size,
            tie_word_embeddings=model.tie_embeddings,
        )
        self.write_config(model, out)
        return out

    def params_from_hf(
        self, tensors: Mapping[str, Any], config, *, where: str = ""
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        flat = read_layout(
            self.layout(model),
            tensors,
            num_layers=model.num_layers,
            stacked=model.use_scan,
            dtype=model.param_dtype,
            family=self.family,
            where=where,
            layer_prefix=self.layer_prefix(model),
        )
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
        return write_layout(
            self.layout(model),
            flat,
            num_layers=model.num_layers,
            stacked=model.use_scan,
            layer_prefix=self.layer_prefix(model),
        )
