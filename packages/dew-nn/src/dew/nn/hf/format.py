"""The :class:`HFFormat` protocol and the registry of Hugging Face families.

A format is one object per family (``model_type``): the ``config.json``
mapping and the tensor layout, both directions. Adding a family is adding
one object and calling :func:`register` on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dew.nn import models


@runtime_checkable
class HFFormat(Protocol):
    """A Hugging Face family <-> a Dew backbone.

    family: the ``model_type`` of its ``config.json`` (``'llama'``).
    architecture: the transformers class it names in ``architectures``
      (``'LlamaForCausalLM'``).
    registry_name: the :mod:`dew.nn.models` name of the backbone it maps to.

    ``config`` below is the Dew model: its options (what :meth:`config_to_dew`
    returns, or ``models.config_of(model)[1]``) or the built module.
    """

    family: str
    architecture: str
    registry_name: str

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        """``(registry name, options)`` of the Dew model a ``config.json`` describes;
        ``models.build(name, **options)`` builds it. Raises on fields that
        change the architecture in a way Dew does not support, and on unknown
        fields not in ``ignore_fields``."""
        ...

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        """The ``config.json`` of the Dew model; raises when the family cannot hold it.

        base: the ``config.json`` the model came from: its fields that Dew
          ignores (token ids, dropout, ...) are kept.
        dtype_name: the dtype the weights are stored in (``'bfloat16'``).
        """
        ...

    def params_from_hf(
        self, tensors: Mapping[str, Any], config, *, where: str = ""
    ) -> dict[str, Any]:
        """The Dew parameter tree (numpy, the model's ``param_dtype``) from the
        checkpoint's ``{name: array}``; raises on a missing, extra or misshapen tensor."""
        ...

    def params_to_hf(self, params, config) -> dict[str, np.ndarray]:
        """The checkpoint's ``{name: array}`` (numpy, the parameters' dtype)."""
        ...


_FORMATS: dict[str, HFFormat] = {}


def register(fmt: HFFormat) -> HFFormat:
    """Add ``fmt`` to the registry under ``fmt.family``; returns it."""
    if not isinstance(fmt, HFFormat):
        raise TypeError(
            f"{type(fmt).__name__} is not an HFFormat: it needs family, architecture, "
            f"registry_name, config_to_dew, config_from_dew, params_from_hf and params_to_hf"
        )
    if fmt.family in _FORMATS and _FORMATS[fmt.family] is not fmt:
        raise ValueError(
            f"Hugging Face family {fmt.family!r} is already registered to "
            f"{_FORMATS[fmt.family]!r}; pick another family name"
        )
    _FORMATS[fmt.family] = fmt
    return fmt


def names() -> list[str]:
    """The registered families, in registration order."""
    return list(_FORMATS)


def get(family: str) -> HFFormat:
    """The format of ``family``; an unknown one lists the registered families."""
    try:
        return _FORMATS[family]
    except KeyError:
        raise ValueError(
            f"unknown Hugging Face family {family!r}; Dew has formats for {', '.join(_FORMATS)}"
        ) from None


def family_of(hf_config: Mapping[str, Any], where: str = "") -> str:
    """The registered family of a ``config.json`` (its ``model_type``, or for very
    old checkpoints its ``architectures``; a diffusers model's ``_class_name``); an
    unsupported one lists the supported."""
    if "_class_name" in hf_config:
        return _diffusers_family(hf_config, where)
    model_type = hf_config.get("model_type")
    if model_type is None:
        by_class = {f.architecture: f.family for f in _FORMATS.values()}
        architectures = hf_config.get("architectures") or ()
        model_type = next((by_class[a] for a in architectures if a in by_class), None)
    if model_type not in _FORMATS:
        supported = ", ".join(f"{f.family} ({f.architecture})" for f in _FORMATS.values())
        raise ValueError(
            f"{where or 'checkpoint'}: architecture model_type={hf_config.get('model_type')!r} "
            f"(architectures {hf_config.get('architectures')}) is not supported; Dew loads "
            f"{supported}"
        )
    return model_type


def _diffusers_family(hf_config: Mapping[str, Any], where: str) -> str:
    """The family of a diffusers model's config (its ``_class_name``)."""
    by_class = {
        f.architecture: f.family
        for f in _FORMATS.values()
        if getattr(f, "library", "transformers") == "diffusers"
    }
    name = hf_config["_class_name"]
    if name not in by_class:
        raise ValueError(
            f"{where or 'checkpoint'}: diffusers class _class_name={name!r} is not supported; "
            f"Dew loads the diffusers classes {', '.join(sorted(by_class)) or '(none)'}"
        )
    return by_class[name]


def as_module(config, registry_name: str) -> nn.Module:
    """``config`` as a built module: a module stays one, options are built."""
    if isinstance(config, nn.Module):
        return config
    return models.build(registry_name, **config)


def param_shapes(model: nn.Module) -> dict[str, jax.ShapeDtypeStruct]:
    """``{'/'-joined path: shape}`` of the model's parameters (traced, nothing computed);
    a model with ``example_inputs()`` (ViT, ViTPredictor, DiT) is traced on those, and on
    ``example_keywords()`` when it has them (a DiT's label and context)."""
    example = getattr(model, "example_inputs", None)
    inputs = example() if example is not None else (jax.ShapeDtypeStruct((1, 1), jnp.int32),)
    keywords = getattr(model, "example_keywords", dict)()
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    shapes = jax.eval_shape(lambda k, a, kw: model.init(k, *a, **kw), key, inputs, keywords)
    return traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")


def check_params(model: nn.Module, flat: Mapping[str, Any], family: str) -> None:
    """Raise unless ``flat`` has exactly the model's parameter paths and shapes."""
    expected = param_shapes(model)
    missing, extra = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
    if missing or extra:
        raise ValueError(
            f"the {family} format and {type(model).__name__} disagree on the parameters: "
            f"missing {missing}, unexpected {extra}; pass the parameters of this model"
        )
    for path, spec in expected.items():
        if tuple(spec.shape) != tuple(np.shape(flat[path])):
            raise ValueError(
                f"parameter {path} has shape {tuple(np.shape(flat[path]))}, the "
                f"{type(model).__name__} expects {tuple(spec.shape)}"
            )
