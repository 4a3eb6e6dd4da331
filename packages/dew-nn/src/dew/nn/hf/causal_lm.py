""":class:`CausalLMFormat`: what every causal-LM family shares.

A family that maps onto :class:`dew.nn.CausalTransformer` says how its
``config.json`` reads (:meth:`~CausalLMFormat.read_options`) and is written
(:meth:`~CausalLMFormat.write_config`), which options it can hold
(:meth:`~CausalLMFormat.requirements`) and how its tensors are laid out
(:meth:`~CausalLMFormat.layout`); this base class and :class:`~dew.nn.hf.layered.LayeredFormat`
turn that into the four conversions of :class:`~dew.nn.hf.HFFormat`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layered import LayeredFormat


class CausalLMFormat(LayeredFormat):
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

    def write_config(self, model, config: dict[str, Any]) -> None:
        """Set the family's fields of ``config`` from ``model``."""
        raise NotImplementedError

    # --------------------------------------------------------------- HFFormat

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        options = self.read_options(fields)
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        # the rope fields are rewritten in the form this version writes
        drop = ("rope_theta", "rope_scaling", "rope_parameters")
        model, out = self.transformers_config(config, base, dtype_name, drop=drop)
        out.update(vocab_size=model.vocab_size, tie_word_embeddings=model.tie_embeddings)
        self.write_config(model, out)
        return out
