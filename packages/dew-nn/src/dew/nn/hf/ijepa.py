"""I-JEPA's image encoder as transformers stores it (``IJepaModel``) <-> :class:`dew.nn.ViT`.

transformers' ``IJepaModel`` is a pre-norm ViT without a class token: a
``Conv2d`` patch embedding (kernel = stride = ``patch_size``), a learned
``[1, patches, hidden]`` position table (the released checkpoints hold
I-JEPA's fixed sine-cosine values in it), LayerNorm (``layer_norm_eps``,
1e-12 by default), erf GELU, biases on every projection, and a final
LayerNorm whose output is ``last_hidden_state``. It is read as a ViT with
``position_embedding='learned'``; a ViT with ``'sincos'`` positions is
written with its table, which transformers then reads as learned.

Tensors come in two spellings, both read: transformers 4's
(``encoder.layer.{i}.attention.attention.query.weight``; what the Hub
checkpoints hold and what transformers 5's ``save_pretrained`` still writes,
so it is what Dew writes) and transformers 5's module names
(``layers.{i}.attention.q_proj.weight``). Not carried: the optional pooler
(``IJepaModel(add_pooling_layer=True)``; its weights are an error) and the
masked-image-modelling ``embeddings.mask_token`` (unused by the forward pass
without ``bool_masked_pos``; skipped on load, not written).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from dew.nn.backbones.vit import sincos_table
from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.format import as_module
from dew.nn.hf.layout import (
    Layout,
    Tensor,
    heads_bias,
    heads_in,
    heads_out,
    linear,
    read_layout,
    same,
    write_layout,
)

# transformers' hidden_act -> Dew's mlp_activation, and back
ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_fast": "gelu",
    "relu": "relu",
}
_WRITTEN_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}

# the module names of one layer: transformers 4 (stored on disk) and transformers 5
_NAMES = {
    "v4": dict(
        layer="encoder.layer.{i}.",
        query="attention.attention.query",
        key="attention.attention.key",
        value="attention.attention.value",
        out="attention.output.dense",
        up="intermediate.dense",
        down="output.dense",
    ),
    "v5": dict(
        layer="layers.{i}.",
        query="attention.q_proj",
        key="attention.k_proj",
        value="attention.v_proj",
        out="attention.o_proj",
        up="mlp.fc1",
        down="mlp.fc2",
    ),
}


def _square(fields: ConfigFields, name: str, default: int) -> int:
    """An ``image_size`` / ``patch_size`` field (an int or ``[height, width]``) of a square."""
    value = fields.get(name, default)
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(
                f"{fields.where}: config.json sets {name}={value!r}; Dew's ViT takes square "
                f"images and patches (one {name})"
            )
        value = value[0]
    return int(value)


def _patch_embedding(patch: int, channels: int, embed: int) -> Tensor:
    """``Conv2d`` weight ``[embed, channels, p, p]`` <-> dense kernel ``[p * p * channels,
    embed]`` over patches flattened as ``(row, column, channel)``."""
    return Tensor(
        "embeddings.patch_embeddings.projection.weight",
        ("patch_embed/kernel",),
        (embed, channels, patch, patch),
        lambda w: (w.transpose(2, 3, 1, 0).reshape(patch * patch * channels, embed),),
        lambda k: k.reshape(patch, patch, channels, embed).transpose(3, 2, 0, 1),
    )


class IJepaFormat:
    """``IJepaModel`` checkpoints (``model_type`` ``'ijepa'``) <-> :class:`dew.nn.ViT`."""

    family = "ijepa"
    architecture = "IJepaModel"
    registry_name = "vit"

    def __repr__(self) -> str:
        return "IJepaFormat()"

    # --------------------------------------------------------------- config

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        emb = fields.get("hidden_size")
        heads = fields.get("num_attention_heads")
        head_dim = fields.get("head_dim", None)
        if head_dim is not None and head_dim * heads != emb:
            raise ValueError(
                f"{fields.where}: config.json sets head_dim={head_dim} with hidden_size {emb} "
                f"and {heads} heads; Dew's ViT needs head_dim = hidden_size / heads"
            )
        activation = fields.expect("hidden_act", tuple(ACTIVATIONS), "gelu")
        fields.expect("qkv_bias", (True,), True)
        # dropout is training-only; the pooler is not part of the features Dew loads
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            fields.get(name, 0.0)
        for name in ("pooler_output_size", "pooler_act"):
            fields.get(name, None)
        options = dict(
            emb_features=emb,
            num_layers=fields.get("num_hidden_layers"),
            num_heads=heads,
            mlp_features=fields.get("intermediate_size"),
            image_size=_square(fields, "image_size", 224),
            patch_size=_square(fields, "patch_size", 16),
            num_channels=fields.get("num_channels", 3),
            position_embedding="learned",
            mlp_activation=ACTIVATIONS[activation],
            norm="layer",
            norm_eps=float(fields.get("layer_norm_eps", 1e-12)),
            use_bias=True,
        )
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def check_expressible(self, config) -> None:
        """Raise unless an ``IJepaModel`` checkpoint can hold the ViT exactly."""
        model = as_module(config, self.registry_name)
        needs = [
            ("num_frames", "None (images)", model.num_frames is None),
            ("norm", "'layer'", model.norm == "layer"),
            ("use_bias", "True", model.use_bias),
            (
                "mlp_activation",
                "'gelu_exact', 'gelu' or 'relu'",
                model.mlp_activation in _WRITTEN_ACTIVATIONS,
            ),
        ]
        wrong = [(o, n) for o, n, ok in needs if not ok]
        if wrong:
            said = "; ".join(f"{o}={n} (the model has {getattr(model, o)!r})" for o, n in wrong)
            raise ValueError(
                f"an {self.family} checkpoint ({self.architecture}) cannot hold this ViT: it "
                f"needs {said}. Save it with format='dew' instead"
            )

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
        out = dict(base or {})
        out.pop("torch_dtype", None)
        out.update(
            architectures=[self.architecture],
            model_type=self.family,
            dtype=dtype_name,
            hidden_size=model.emb_features,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads,
            intermediate_size=model.mlp_features,
            hidden_act=_WRITTEN_ACTIVATIONS[model.mlp_activation],
            layer_norm_eps=model.norm_eps,
            image_size=model.image_size,
            patch_size=model.patch_size,
            num_channels=model.num_channels,
            qkv_bias=True,
        )
        out.pop("head_dim", None)
        return out

    # --------------------------------------------------------------- tensors

    def layout(self, model, spelling: str = "v4") -> Layout:
        e, h, m = model.emb_features, model.num_heads, model.mlp_features
        d, n = e // h, _NAMES[spelling]
        return Layout(
            prefix="",
            layer=n["layer"],
            globals=(
                _patch_embedding(model.patch_size, model.num_channels, e),
                same("embeddings.patch_embeddings.projection.bias", "patch_embed/bias", (e,)),
                Tensor(
                    "embeddings.position_embeddings",
                    ("position_embed",),
                    (1, model.num_patches, e),
                    lambda w: (w[0],),
                    lambda t: t[None],
                ),
                same("layernorm.weight", "final_norm/scale", (e,)),
                same("layernorm.bias", "final_norm/bias", (e,)),
            ),
            per_layer=(
                same("layernorm_before.weight", "attention_norm/scale", (e,)),
                same("layernorm_before.bias", "attention_norm/bias", (e,)),
                *(
                    t
                    for kind in ("query", "key", "value")
                    for t in (
                        heads_in(f"{n[kind]}.weight", f"attention/{kind}_kernel", h, d, e),
                        heads_bias(f"{n[kind]}.bias", f"attention/{kind}_bias", h, d),
                    )
                ),
                heads_out(f"{n['out']}.weight", "attention/out_kernel", h, d, e, transposed=True),
                same(f"{n['out']}.bias", "attention/out_bias", (e,)),
                same("layernorm_after.weight", "mlp_norm/scale", (e,)),
                same("layernorm_after.bias", "mlp_norm/bias", (e,)),
                linear(f"{n['up']}.weight", "mlp/up/kernel", m, e),
                same(f"{n['up']}.bias", "mlp/up/bias", (m,)),
                linear(f"{n['down']}.weight", "mlp/down/kernel", e, m),
                same(f"{n['down']}.bias", "mlp/down/bias", (e,)),
            ),
            lm_head=None,
            buffers=re.compile(r"^embeddings\.mask_token$"),
        )

    @staticmethod
    def layer_prefix(model):
        stack = model.layer_stack()
        return (lambda i: stack.name) if stack.use_scan else stack.layer_name

    def params_from_hf(
        self, tensors: Mapping[str, Any], config, *, where: str = ""
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        spelling = "v5" if any(k.startswith("layers.") for k in tensors.keys()) else "v4"
        flat = read_layout(
            self.layout(model, spelling),
            tensors,
            num_layers=model.num_layers,
            stacked=model.use_scan,
            dtype=model.param_dtype,
            family=self.family,
            where=where,
            layer_prefix=self.layer_prefix(model),
        )
        if model.position_embedding == "sincos":
            table = flat.pop("position_embed")
            want = sincos_table(model.emb_features, model.grid.shape)
            if not np.allclose(np.asarray(table, np.float32), want, atol=1e-4):
                raise ValueError(
                    f"{where or 'checkpoint'}: embeddings.position_embeddings is not the "
                    f"sine-cosine table of a ViT with position_embedding='sincos'; load it "
                    f"into position_embedding='learned'"
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
        if model.position_embedding == "sincos":
            dtype = flat["patch_embed/kernel"].dtype
            flat["position_embed"] = sincos_table(model.emb_features, model.grid.shape).astype(
                dtype
            )
        return write_layout(
            self.layout(model),
            flat,
            num_layers=model.num_layers,
            stacked=model.use_scan,
            layer_prefix=self.layer_prefix(model),
        )


def param_shapes(model: nn.Module) -> dict[str, jax.ShapeDtypeStruct]:
    """``{'/'-joined path: shape}`` of a ViT's parameters (traced, nothing computed)."""
    shapes = jax.eval_shape(
        model.init, jax.ShapeDtypeStruct((2,), np.uint32), *model.example_inputs()
    )
    return traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")


def check_params(model: nn.Module, flat: Mapping[str, Any], family: str) -> None:
    """Raise unless ``flat`` has exactly the ViT's parameter paths and shapes."""
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


IJEPA = IJepaFormat()
