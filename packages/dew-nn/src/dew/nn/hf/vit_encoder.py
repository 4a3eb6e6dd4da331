""":class:`ViTEncoderFormat`: what transformers' JEPA encoders (I-JEPA, V-JEPA 2) share.

Both are pre-norm ViTs without a class token that load into :class:`dew.nn.ViT`:
LayerNorm, biases on every projection, one of a few GELU / ReLU activations,
and per layer the same eight tensors (two LayerNorms, q/k/v/out projections,
a two-layer MLP) under family-specific names. A family adds its own
``config.json`` fields (:meth:`~ViTEncoderFormat.write_config`), options
(:meth:`~ViTEncoderFormat.requirements`) and global tensors
(:meth:`~ViTEncoderFormat.layout`, built with :func:`encoder_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layered import LayeredFormat, full_width_heads
from dew.nn.hf.layout import Tensor, heads_bias, heads_in, heads_out, linear, same

# transformers' hidden_act -> Dew's mlp_activation, and back
ACTIVATIONS = {
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu_fast": "gelu",
    "relu": "relu",
}
WRITTEN_ACTIVATIONS = {"gelu_exact": "gelu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}


def encoder_layer(names: Mapping[str, str], model) -> tuple[Tensor, ...]:
    """One encoder layer's tensors; ``names`` maps ``attention_norm``, ``query``, ``key``,
    ``value``, ``out``, ``mlp_norm``, ``up`` and ``down`` to the family's module names."""
    e, h, m = model.emb_features, model.num_heads, model.mlp_features
    d = e // h
    n = names
    return (
        same(f"{n['attention_norm']}.weight", "attention_norm/scale", (e,)),
        same(f"{n['attention_norm']}.bias", "attention_norm/bias", (e,)),
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
        same(f"{n['mlp_norm']}.weight", "mlp_norm/scale", (e,)),
        same(f"{n['mlp_norm']}.bias", "mlp_norm/bias", (e,)),
        linear(f"{n['up']}.weight", "mlp/up/kernel", m, e),
        same(f"{n['up']}.bias", "mlp/up/bias", (m,)),
        linear(f"{n['down']}.weight", "mlp/down/kernel", e, m),
        same(f"{n['down']}.bias", "mlp/down/bias", (e,)),
    )


class ViTEncoderFormat(LayeredFormat):
    """Base of the transformers JEPA encoder formats (``registry_name`` ``'vit'``).

    Subclasses set ``family``, ``architecture`` and ``default_norm_eps`` and implement
    :meth:`write_config` and :meth:`layout`; they extend :meth:`requirements`.
    """

    registry_name = "vit"
    model_noun = "ViT"
    default_norm_eps: float  # layer_norm_eps when config.json does not set it

    @property
    def holder(self) -> str:
        article = "an" if self.family[0] in "aeiou" else "a"
        return f"{article} {self.family} checkpoint ({self.architecture})"

    def write_config(self, model, config: dict[str, Any]) -> None:
        """Set the family's own fields of ``config`` from ``model``."""
        raise NotImplementedError

    def encoder_options(self, fields: ConfigFields) -> dict[str, Any]:
        """The options every JEPA encoder reads the same way (size, activation, norm)."""
        activation = fields.expect("hidden_act", tuple(ACTIVATIONS), "gelu")
        fields.expect("qkv_bias", (True,), True)
        return dict(
            emb_features=fields.count("hidden_size"),
            num_layers=fields.count("num_hidden_layers"),
            num_heads=fields.count("num_attention_heads"),
            mlp_activation=ACTIVATIONS[activation],
            norm="layer",
            norm_eps=float(fields.get("layer_norm_eps", self.default_norm_eps)),
            use_bias=True,
        )

    def requirements(self, model) -> list[tuple[str, Any, bool]]:
        return [
            ("norm", "'layer'", model.norm == "layer"),
            *full_width_heads(model),
            ("use_bias", "True", model.use_bias),
            (
                "mlp_activation",
                "'gelu_exact', 'gelu' or 'relu'",
                model.mlp_activation in WRITTEN_ACTIVATIONS,
            ),
        ]

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        model, out = self.transformers_config(config, base, dtype_name)
        out.update(
            hidden_size=model.emb_features,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads,
            hidden_act=WRITTEN_ACTIVATIONS[model.mlp_activation],
            layer_norm_eps=model.norm_eps,
            patch_size=model.patch_size,
            qkv_bias=True,
        )
        self.write_config(model, out)
        return out
