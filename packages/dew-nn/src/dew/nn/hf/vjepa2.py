"""V-JEPA 2's video encoder as transformers stores it (``VJEPA2Model``) <-> :class:`dew.nn.ViT`.

transformers' ``VJEPA2Model`` holds an encoder and a predictor. The encoder
is a pre-norm ViT over tubelets: a ``Conv3d`` patch embedding (kernel =
stride = ``(tubelet_size, patch_size, patch_size)``), no position table and
no class token; every attention layer rotates queries and keys by the
tubelet's grid coordinates (time, row, column), V-JEPA 2's 3-D rotary
embedding (:func:`dew.nn.rope.apply_axial_rope`); LayerNorm
(``layer_norm_eps``), erf GELU, biases on every projection, a final
LayerNorm whose output is ``last_hidden_state``. It is read as a ViT with
``position_embedding='rope'``, ``num_frames = frames_per_clip``.

transformers computes the encoder for any number of frames; Dew's ViT takes
``num_frames`` of them: for clips of another length, ``model.clone(num_frames=...)``
(the parameters do not depend on it).

Loaded: ``encoder.*``. Skipped: the predictor (``predictor.*``; Dew loads the
encoder, whose features are what a downstream model reads). Written: the
encoder only, with a ``config.json`` that transformers reads; its
``VJEPA2Model.from_pretrained`` then initialises a fresh predictor (and says
so). Checkpoints of other V-JEPA 2 classes (``VJEPA2ForVideoClassification``)
are refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.format import as_module, check_params
from dew.nn.hf.ijepa import ACTIVATIONS
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

# Dew's mlp_activation -> the hidden_act written
WRITTEN_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}
# config.json fields of the parts Dew does not load (the predictor, the
# classifier's pooler) and training-only settings
UNUSED_FIELDS = (
    "pred_hidden_size",
    "pred_num_attention_heads",
    "pred_num_hidden_layers",
    "pred_num_mask_tokens",
    "pred_zero_init_mask_tokens",
    "pred_mlp_ratio",
    "num_pooler_layers",
    "drop_path_rate",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    # in the Hub's config.json, unread by transformers' VJEPA2Model (crop_size sets the size)
    "image_size",
    "wide_SiLU",
)


def _patch_embedding(tubelet: int, patch: int, channels: int, embed: int) -> Tensor:
    """``Conv3d`` weight ``[embed, channels, t, p, p]`` <-> dense kernel ``[t * p * p *
    channels, embed]`` over tubelets flattened as ``(frame, row, column, channel)``."""
    return Tensor(
        "embeddings.patch_embeddings.proj.weight",
        ("patch_embed/kernel",),
        (embed, channels, tubelet, patch, patch),
        lambda w: (w.transpose(2, 3, 4, 1, 0).reshape(tubelet * patch * patch * channels, embed),),
        lambda k: k.reshape(tubelet, patch, patch, channels, embed).transpose(4, 3, 0, 1, 2),
    )


class VJepa2Format:
    """``VJEPA2Model`` checkpoints (``model_type`` ``'vjepa2'``), their encoder <->
    :class:`dew.nn.ViT` with ``position_embedding='rope'``."""

    family = "vjepa2"
    architecture = "VJEPA2Model"
    registry_name = "vit"

    def __repr__(self) -> str:
        return "VJepa2Format()"

    # --------------------------------------------------------------- config

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        architectures = [a for a in hf_config.get("architectures") or () if a != self.architecture]
        if architectures:
            raise ValueError(
                f"{fields.where}: config.json names architectures {architectures}; Dew's "
                f"{self.family} format loads {self.architecture} (the encoder) only. Save "
                f"the model's .vjepa2 submodule with VJEPA2Model.save_pretrained and load that"
            )
        emb = fields.get("hidden_size")
        heads = fields.get("num_attention_heads")
        if emb % heads:
            raise ValueError(
                f"{fields.where}: hidden_size {emb} does not divide over num_attention_heads "
                f"{heads}"
            )
        patch = fields.get("patch_size", 16)
        if not isinstance(patch, int):
            raise ValueError(
                f"{fields.where}: config.json sets patch_size={patch!r}; V-JEPA 2 (and Dew's "
                f"ViT) take one int, the side of a square patch"
            )
        ratio = fields.get("mlp_ratio", 4.0)
        activation = fields.expect("hidden_act", tuple(ACTIVATIONS), "gelu")
        fields.expect("qkv_bias", (True,), True)
        # the original code's SwiGLU switch, which transformers' VJEPA2MLP does not have
        fields.expect("use_SiLU", (False,), False)
        for name in UNUSED_FIELDS:
            fields.get(name, None)
        options = dict(
            emb_features=emb,
            num_layers=fields.get("num_hidden_layers"),
            num_heads=heads,
            mlp_features=int(emb * ratio),  # as transformers' VJEPA2MLP
            image_size=fields.get("crop_size", 256),
            patch_size=patch,
            num_channels=fields.get("in_chans", 3),
            num_frames=fields.get("frames_per_clip", 64),
            tubelet_size=fields.get("tubelet_size", 2),
            position_embedding="rope",
            mlp_activation=ACTIVATIONS[activation],
            norm="layer",
            norm_eps=float(fields.get("layer_norm_eps", 1e-6)),
            use_bias=True,
        )
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def check_expressible(self, config) -> None:
        """Raise unless a ``VJEPA2Model`` checkpoint can hold the ViT exactly."""
        model = as_module(config, self.registry_name)
        e, m = model.emb_features, model.mlp_features
        needs = [
            ("num_frames", "a number of frames (video)", model.num_frames is not None),
            ("position_embedding", "'rope'", model.position_embedding == "rope"),
            ("norm", "'layer'", model.norm == "layer"),
            ("use_bias", "True", model.use_bias),
            (
                "mlp_activation",
                "'gelu_exact', 'gelu' or 'relu'",
                model.mlp_activation in WRITTEN_ACTIVATIONS,
            ),
            (
                "mlp_features",
                f"int({e} * mlp_ratio) for mlp_ratio = mlp_features / {e}",
                int(e * (m / e)) == m,
            ),
        ]
        wrong = [(o, n) for o, n, ok in needs if not ok]
        if wrong:
            said = "; ".join(f"{o}={n} (the model has {getattr(model, o)!r})" for o, n in wrong)
            raise ValueError(
                f"a {self.family} checkpoint ({self.architecture}) cannot hold this ViT: it "
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
            mlp_ratio=model.mlp_features / model.emb_features,
            hidden_act=WRITTEN_ACTIVATIONS[model.mlp_activation],
            layer_norm_eps=model.norm_eps,
            crop_size=model.image_size,
            patch_size=model.patch_size,
            in_chans=model.num_channels,
            frames_per_clip=model.num_frames,
            tubelet_size=model.tubelet_size,
            qkv_bias=True,
        )
        return out

    # --------------------------------------------------------------- tensors

    def layout(self, model) -> Layout:
        e, h, m = model.emb_features, model.num_heads, model.mlp_features
        d = e // h
        return Layout(
            prefix="encoder.",
            layer="layer.{i}.",
            globals=(
                _patch_embedding(model.tubelet_size, model.patch_size, model.num_channels, e),
                same("embeddings.patch_embeddings.proj.bias", "patch_embed/bias", (e,)),
                same("layernorm.weight", "final_norm/scale", (e,)),
                same("layernorm.bias", "final_norm/bias", (e,)),
            ),
            per_layer=(
                same("norm1.weight", "attention_norm/scale", (e,)),
                same("norm1.bias", "attention_norm/bias", (e,)),
                *(
                    t
                    for kind in ("query", "key", "value")
                    for t in (
                        heads_in(f"attention.{kind}.weight", f"attention/{kind}_kernel", h, d, e),
                        heads_bias(f"attention.{kind}.bias", f"attention/{kind}_bias", h, d),
                    )
                ),
                heads_out(
                    "attention.proj.weight", "attention/out_kernel", h, d, e, transposed=True
                ),
                same("attention.proj.bias", "attention/out_bias", (e,)),
                same("norm2.weight", "mlp_norm/scale", (e,)),
                same("norm2.bias", "mlp_norm/bias", (e,)),
                linear("mlp.fc1.weight", "mlp/up/kernel", m, e),
                same("mlp.fc1.bias", "mlp/up/bias", (m,)),
                linear("mlp.fc2.weight", "mlp/down/kernel", e, m),
                same("mlp.fc2.bias", "mlp/down/bias", (e,)),
            ),
            lm_head=None,
            buffers=re.compile(r"^predictor\."),  # the predictor is not loaded
        )

    @staticmethod
    def layer_prefix(model):
        stack = model.layer_stack()
        return (lambda i: stack.name) if stack.use_scan else stack.layer_name

    def params_from_hf(
        self, tensors: Mapping[str, Any], config, *, where: str = ""
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
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


VJEPA2 = VJepa2Format()
