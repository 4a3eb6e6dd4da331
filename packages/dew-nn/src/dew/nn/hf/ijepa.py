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

import numpy as np

from dew.nn.backbones.vit import sincos_table
from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layout import Layout, Tensor, patch_embedding, same
from dew.nn.hf.vit_encoder import ViTEncoderFormat, encoder_layer

# the module names of one layer: transformers 4 (stored on disk) and transformers 5
_NAMES = {
    "v4": dict(
        layer="encoder.layer.{i}.",
        attention_norm="layernorm_before",
        query="attention.attention.query",
        key="attention.attention.key",
        value="attention.attention.value",
        out="attention.output.dense",
        mlp_norm="layernorm_after",
        up="intermediate.dense",
        down="output.dense",
    ),
    "v5": dict(
        layer="layers.{i}.",
        attention_norm="layernorm_before",
        query="attention.q_proj",
        key="attention.k_proj",
        value="attention.v_proj",
        out="attention.o_proj",
        mlp_norm="layernorm_after",
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


class IJepaFormat(ViTEncoderFormat):
    """``IJepaModel`` checkpoints (``model_type`` ``'ijepa'``) <-> :class:`dew.nn.ViT`."""

    family = "ijepa"
    architecture = "IJepaModel"
    default_norm_eps = 1e-12

    # --------------------------------------------------------------- config

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        emb = fields.count("hidden_size")
        heads = fields.count("num_attention_heads")
        head_dim = fields.count("head_dim", None, optional=True)
        if head_dim is not None and head_dim * heads != emb:
            raise ValueError(
                f"{fields.where}: config.json sets head_dim={head_dim} with hidden_size {emb} "
                f"and {heads} heads; Dew's ViT needs head_dim = hidden_size / heads"
            )
        options = self.encoder_options(fields)
        # dropout is training-only; the pooler is not part of the features Dew loads
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            fields.get(name, 0.0)
        for name in ("pooler_output_size", "pooler_act"):
            fields.get(name, None)
        options.update(
            mlp_features=fields.count("intermediate_size"),
            image_size=_square(fields, "image_size", 224),
            patch_size=_square(fields, "patch_size", 16),
            num_channels=fields.get("num_channels", 3),
            position_embedding="learned",
        )
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def requirements(self, model) -> list[tuple[str, Any, bool]]:
        """An image ViT (no frames) with the encoders' norm, biases and activation."""
        return [("num_frames", "None (images)", model.num_frames is None)] + super().requirements(
            model
        )

    def write_config(self, model, config: dict[str, Any]) -> None:
        config.update(
            intermediate_size=model.mlp_features,
            image_size=model.image_size,
            num_channels=model.num_channels,
        )
        config.pop("head_dim", None)

    # --------------------------------------------------------------- tensors

    def layout(self, model, spelling: str = "v4") -> Layout:
        e = model.emb_features
        return Layout(
            prefix="",
            layer=_NAMES[spelling]["layer"],
            globals=(
                patch_embedding(
                    "embeddings.patch_embeddings.projection.weight",
                    (model.patch_size, model.patch_size),
                    model.num_channels,
                    e,
                ),
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
            per_layer=encoder_layer(_NAMES[spelling], model),
            lm_head=None,
            buffers=re.compile(r"^embeddings\.mask_token$"),
        )

    def read_layout_of(self, model, tensors: Mapping[str, Any]) -> Layout:
        """transformers 5's spelling when the tensors have it, else transformers 4's."""
        spelling = "v5" if any(k.startswith("layers.") for k in tensors.keys()) else "v4"
        return self.layout(model, spelling)

    def after_read(self, flat: dict, tensors: Mapping[str, Any], model, where: str) -> None:
        """A ``'sincos'`` ViT stores no table: check the checkpoint's is that table, drop it."""
        if model.position_embedding == "sincos":
            table = flat.pop("position_embed")
            want = sincos_table(model.emb_features, model.grid.shape)
            if not np.allclose(np.asarray(table, np.float32), want, atol=1e-4):
                raise ValueError(
                    f"{where or 'checkpoint'}: embeddings.position_embeddings is not the "
                    f"sine-cosine table of a ViT with position_embedding='sincos'; load it "
                    f"into position_embedding='learned'"
                )

    def before_write(self, flat: dict, model) -> None:
        """A ``'sincos'`` ViT is written with its table, which transformers reads as learned."""
        if model.position_embedding == "sincos":
            dtype = flat["patch_embed/kernel"].dtype
            table = sincos_table(model.emb_features, model.grid.shape)
            flat["position_embed"] = table.astype(dtype)


IJEPA = IJepaFormat()
