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

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layout import Layout, patch_embedding, same
from dew.nn.hf.vit_encoder import ViTEncoderFormat, encoder_layer

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
# the module names of one encoder layer
_NAMES = dict(
    attention_norm="norm1",
    query="attention.query",
    key="attention.key",
    value="attention.value",
    out="attention.proj",
    mlp_norm="norm2",
    up="mlp.fc1",
    down="mlp.fc2",
)


class VJepa2Format(ViTEncoderFormat):
    """``VJEPA2Model`` checkpoints (``model_type`` ``'vjepa2'``), their encoder <->
    :class:`dew.nn.ViT` with ``position_embedding='rope'``."""

    family = "vjepa2"
    architecture = "VJEPA2Model"
    default_norm_eps = 1e-6
    check_on_read = True

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
        emb = fields.count("hidden_size")
        heads = fields.count("num_attention_heads")
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
        options = self.encoder_options(fields)
        # the original code's SwiGLU switch, which transformers' VJEPA2MLP does not have
        fields.expect("use_SiLU", (False,), False)
        for name in UNUSED_FIELDS:
            fields.get(name, None)
        options.update(
            mlp_features=int(emb * ratio),  # as transformers' VJEPA2MLP
            image_size=fields.get("crop_size", 256),
            patch_size=patch,
            num_channels=fields.get("in_chans", 3),
            num_frames=fields.get("frames_per_clip", 64),
            tubelet_size=fields.get("tubelet_size", 2),
            position_embedding="rope",
        )
        fields.check_unknown(ignore_fields)
        return self.registry_name, options

    def requirements(self, model) -> list[tuple[str, Any, bool]]:
        """A video ViT with 3-D rotary positions, the encoders' norm, biases and
        activation, and an MLP width that ``mlp_ratio`` gives back."""
        e, m = model.emb_features, model.mlp_features
        return [
            ("num_frames", "a number of frames (video)", model.num_frames is not None),
            ("position_embedding", "'rope'", model.position_embedding == "rope"),
            *super().requirements(model),
            (
                "mlp_features",
                f"int({e} * mlp_ratio) for mlp_ratio = mlp_features / {e}",
                int(e * (m / e)) == m,
            ),
        ]

    def write_config(self, model, config: dict[str, Any]) -> None:
        config.update(
            mlp_ratio=model.mlp_features / model.emb_features,
            crop_size=model.image_size,
            in_chans=model.num_channels,
            frames_per_clip=model.num_frames,
            tubelet_size=model.tubelet_size,
        )

    # --------------------------------------------------------------- tensors

    def layout(self, model) -> Layout:
        e, p = model.emb_features, model.patch_size
        return Layout(
            prefix="encoder.",
            layer="layer.{i}.",
            globals=(
                patch_embedding(
                    "embeddings.patch_embeddings.proj.weight",
                    (model.tubelet_size, p, p),
                    model.num_channels,
                    e,
                ),
                same("embeddings.patch_embeddings.proj.bias", "patch_embed/bias", (e,)),
                same("layernorm.weight", "final_norm/scale", (e,)),
                same("layernorm.bias", "final_norm/bias", (e,)),
            ),
            per_layer=encoder_layer(_NAMES, model),
            lm_head=None,
            buffers=re.compile(r"^predictor\."),  # the predictor is not loaded
        )


VJEPA2 = VJepa2Format()
