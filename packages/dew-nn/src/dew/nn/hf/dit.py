"""diffusers' ``DiTTransformer2DModel`` (``_class_name`` in its ``config.json``) <->
:class:`dew.nn.DiT`.

diffusers' DiT is Peebles & Xie's: a ``Conv2d`` patch embedding (kernel =
stride = ``patch_size``) plus fixed 2-D sine-cosine positions (a buffer, not
stored), ``num_layers`` ``BasicTransformerBlock`` with ``norm_type='ada_norm_zero'``
(``norm1.linear``: the six modulations; ``attn1``: q/k/v with
``attention_bias``, an output projection with bias; ``ff``: Linear, tanh-GELU,
Linear at 4x width; parameter-free LayerNorms, eps 1e-6 before the attention
and ``norm_eps`` before the MLP), then ``proj_out_1`` (the final shift and
scale), a LayerNorm (eps 1e-6) and ``proj_out_2``. Its timestep embedding is
``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)`` (Dew's
``time_freq_shift=1``), and its label table has ``num_embeds_ada_norm + 1``
rows, the last the null class.

One difference of layout: diffusers keeps a copy of the timestep MLP and the
label table in every block (``transformer_blocks.{i}.norm1.emb``, and reads
block 0's for the final layer); DiT, and Dew, have one. Checkpoints converted
from DiT hold equal copies; loading checks they are equal (a checkpoint whose
copies were trained apart is refused, naming the tensor), and saving writes
the one table into every block.

The weights file is ``diffusion_pytorch_model.safetensors``; a pipeline
directory keeps the model under ``transformer/``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.format import as_module
from dew.nn.hf.layered import LayeredFormat, full_width_heads
from dew.nn.hf.layout import (
    Layout,
    Tensor,
    heads_bias,
    heads_in,
    heads_out,
    linear,
    patch_embedding,
    same,
)

DIFFUSERS_VERSION = "0.42.1"  # written when the config did not come from diffusers
ACTIVATIONS = {"gelu-approximate": "gelu", "gelu": "gelu_exact"}
_WRITTEN = {v: k for k, v in ACTIVATIONS.items()}  # Dew's mlp_activation -> activation_fn
# diffusers' bookkeeping fields of every config.json
_BOOKKEEPING = ("_class_name", "_diffusers_version", "_name_or_path", "_use_default_values")
_TIME_FEATURES = 256  # Timesteps(num_channels=256) in CombinedTimestepLabelEmbeddings
_EMBEDDING = "norm1.emb."  # the per-block copy of the conditioning embedding


def _embedding_tensors(model) -> tuple[Tensor, ...]:
    """The conditioning embedding as one block stores it (relative to ``norm1.emb.``)."""
    e = model.emb_features
    return (
        linear("timestep_embedder.linear_1.weight", "time_in/kernel", e, _TIME_FEATURES),
        same("timestep_embedder.linear_1.bias", "time_in/bias", (e,)),
        linear("timestep_embedder.linear_2.weight", "time_out/kernel", e, e),
        same("timestep_embedder.linear_2.bias", "time_out/bias", (e,)),
        same("class_embedder.embedding_table.weight", "label_embed", (model.num_classes + 1, e)),
    )


class DiTFormat(LayeredFormat):
    """diffusers ``DiTTransformer2DModel`` directories <-> :class:`dew.nn.DiT`."""

    family = "dit"
    architecture = "DiTTransformer2DModel"
    registry_name = "dit"
    library = "diffusers"
    weights_name = "diffusion_pytorch_model"  # the safetensors file's stem
    model_noun = "DiT"

    @property
    def holder(self) -> str:
        return f"a diffusers {self.architecture}"

    # --------------------------------------------------------------- config

    def config_to_dew(
        self, hf_config: Mapping[str, Any], *, where: str = "", ignore_fields: Iterable[str] = ()
    ) -> tuple[str, dict[str, Any]]:
        fields = ConfigFields(hf_config, self.family, where)
        fields.expect("_class_name", (self.architecture,), self.architecture)
        heads = int(fields.count("num_attention_heads", 16))
        head_dim = int(fields.count("attention_head_dim", 72))
        in_channels = int(fields.count("in_channels", 4))
        out_channels = fields.get("out_channels", None)
        if out_channels not in (None, in_channels, 2 * in_channels):
            raise ValueError(
                f"{fields.where}: config.json sets out_channels={out_channels} with in_channels "
                f"{in_channels}; Dew's DiT outputs in_channels (the prediction) or "
                f"2 * in_channels (learn_sigma)"
            )
        patch = fields.count("patch_size", 2)
        size = fields.get("sample_size", 32)
        for name, value in (("patch_size", patch), ("sample_size", size)):
            if not isinstance(value, int):
                raise ValueError(
                    f"{fields.where}: config.json sets {name}={value!r}; a "
                    f"{self.architecture} takes one integer (square inputs)"
                )
        classes = fields.get("num_embeds_ada_norm", 1000)
        if not isinstance(classes, int) or classes < 1:
            raise ValueError(
                f"{fields.where}: config.json sets num_embeds_ada_norm={classes!r}; a "
                f"{self.architecture} needs the number of classes (an integer >= 1)"
            )
        activation = fields.expect("activation_fn", tuple(ACTIVATIONS), "gelu-approximate")
        fields.expect("norm_type", ("ada_norm_zero",), "ada_norm_zero")
        fields.expect("norm_elementwise_affine", (False,), False)
        # training-only (dropout) or not read by DiT's forward pass (GroupNorm
        # groups; upcasting changes only low-precision numerics)
        fields.get("dropout", 0.0)
        fields.get("norm_num_groups", 32)
        fields.get("upcast_attention", False)
        options = dict(
            sample_size=size,
            patch_size=patch,
            in_channels=in_channels,
            emb_features=heads * head_dim,
            num_layers=int(fields.count("num_layers", 28)),
            num_heads=heads,
            mlp_features=4 * heads * head_dim,
            num_classes=classes,
            learn_sigma=out_channels == 2 * in_channels,
            context_features=0,
            time_features=_TIME_FEATURES,
            time_freq_shift=1.0,
            mlp_activation=ACTIVATIONS[activation],
            norm_eps=1e-6,
            mlp_norm_eps=float(fields.get("norm_eps", 1e-5)),
            use_qkv_bias=bool(fields.get("attention_bias", True)),
        )
        fields.check_unknown((*_BOOKKEEPING, *ignore_fields))
        return self.registry_name, options

    def requirements(self, model) -> list[tuple[str, Any, bool]]:
        e = model.emb_features
        height, width = model.sample_shape
        return [
            ("num_classes", ">= 1 (diffusers' DiT always reads a class label)", model.num_classes),
            ("context_features", "0 (no cross-attention)", not model.context_features),
            ("sample_size", "square", height == width),
            ("time_features", _TIME_FEATURES, model.time_features == _TIME_FEATURES),
            ("time_freq_shift", 1.0, model.time_freq_shift == 1.0),
            ("mlp_features", f"4 * emb_features = {4 * e}", model.mlp_features == 4 * e),
            ("mlp_activation", "'gelu' or 'gelu_exact'", model.mlp_activation in _WRITTEN),
            ("norm_eps", 1e-6, model.norm_eps == 1e-6),
            *full_width_heads(model),
        ]

    def config_from_dew(
        self, config, *, base: Mapping[str, Any] | None = None, dtype_name: str = "float32"
    ) -> dict[str, Any]:
        model = as_module(config, self.registry_name)
        self.check_expressible(model)
        out = dict(base or {})
        out.setdefault("_diffusers_version", DIFFUSERS_VERSION)
        mlp_eps = model.norm_eps if model.mlp_norm_eps is None else model.mlp_norm_eps
        out.update(
            _class_name=self.architecture,
            num_attention_heads=model.num_heads,
            attention_head_dim=model.emb_features // model.num_heads,
            in_channels=model.in_channels,
            out_channels=model.out_channels,
            num_layers=model.num_layers,
            attention_bias=model.use_qkv_bias,
            sample_size=model.sample_shape[0],
            patch_size=model.patch_size,
            activation_fn=_WRITTEN[model.mlp_activation],
            num_embeds_ada_norm=model.num_classes,
            norm_type="ada_norm_zero",
            norm_elementwise_affine=False,
            norm_eps=mlp_eps,
        )
        out.setdefault("dropout", 0.0)
        out.setdefault("norm_num_groups", 32)
        out.setdefault("upcast_attention", False)
        return out

    # --------------------------------------------------------------- tensors

    def layout(self, model) -> Layout:
        e, h, m = model.emb_features, model.num_heads, model.mlp_features
        d, p = e // h, model.patch_size
        out = p * p * model.out_channels
        qkv = []
        for kind, name in (("query", "to_q"), ("key", "to_k"), ("value", "to_v")):
            qkv.append(heads_in(f"attn1.{name}.weight", f"attention/{kind}_kernel", h, d, e))
            if model.use_qkv_bias:
                qkv.append(heads_bias(f"attn1.{name}.bias", f"attention/{kind}_bias", h, d))
        return Layout(
            prefix="",
            layer="transformer_blocks.{i}.",
            globals=(
                patch_embedding("pos_embed.proj.weight", (p, p), model.in_channels, e),
                same("pos_embed.proj.bias", "patch_embed/bias", (e,)),
                linear("proj_out_1.weight", "final_modulation/kernel", 2 * e, e),
                same("proj_out_1.bias", "final_modulation/bias", (2 * e,)),
                linear("proj_out_2.weight", "head/kernel", out, e),
                same("proj_out_2.bias", "head/bias", (out,)),
            ),
            per_layer=(
                linear("norm1.linear.weight", "modulation/kernel", 6 * e, e),
                same("norm1.linear.bias", "modulation/bias", (6 * e,)),
                *qkv,
                heads_out("attn1.to_out.0.weight", "attention/out_kernel", h, d, e, transposed=1),
                same("attn1.to_out.0.bias", "attention/out_bias", (e,)),
                linear("ff.net.0.proj.weight", "mlp/up/kernel", m, e),
                same("ff.net.0.proj.bias", "mlp/up/bias", (m,)),
                linear("ff.net.2.weight", "mlp/down/kernel", e, m),
                same("ff.net.2.bias", "mlp/down/bias", (e,)),
            ),
            lm_head=None,
            # read apart (one copy for all blocks); pos_embed.pos_embed is a buffer
            buffers=re.compile(r"^transformer_blocks\.\d+\.norm1\.emb\.|^pos_embed\.pos_embed$"),
        )

    def after_read(self, flat: dict, tensors: Mapping[str, Any], model, where: str) -> None:
        """Add block 0's conditioning embedding, after checking every block holds the same."""
        where = f"{where}: " if where else ""
        names = set(tensors.keys())
        for tensor in _embedding_tensors(model):
            first = None
            for i in range(model.num_layers):
                name = f"transformer_blocks.{i}.{_EMBEDDING}{tensor.name}"
                if name not in names:
                    raise ValueError(
                        f"{where}the checkpoint has no tensor {name!r} (shape {tensor.shape}, "
                        f"for Dew's {tensor.paths[0]})"
                    )
                value = np.asarray(tensors[name])
                if value.shape != tensor.shape:
                    raise ValueError(
                        f"{where}tensor {name!r} has shape {value.shape}, but config.json "
                        f"needs {tensor.shape} (for Dew's {tensor.paths[0]})"
                    )
                if first is None:
                    first = value
                elif not np.array_equal(value, first):
                    raise ValueError(
                        f"{where}{name!r} differs from block 0's copy: Dew's DiT has one "
                        f"timestep embedding and label table for all blocks (as the DiT "
                        f"paper); checkpoints converted from DiT hold equal copies in every "
                        f"transformer_blocks.{{i}}.{_EMBEDDING}*, this one does not"
                    )
            flat[tensor.paths[0]] = np.asarray(tensor.to_dew(first)[0], model.param_dtype)

    def after_write(self, out: dict, flat: Mapping[str, Any], model) -> None:
        """Write the one conditioning embedding into every block."""
        for tensor in _embedding_tensors(model):
            value = np.ascontiguousarray(tensor.to_hf(flat[tensor.paths[0]]))
            for i in range(model.num_layers):
                out[f"transformer_blocks.{i}.{_EMBEDDING}{tensor.name}"] = value


DIT = DiTFormat()
