"""Llama, Mistral and Qwen2: pre-norm RMSNorm, RoPE, SwiGLU, grouped-query attention.

The three share one layout (``model.layers.{i}.self_attn.q_proj.weight``, ...)
and differ in a few fields: Mistral slides an attention window, Qwen2 adds
q/k/v biases and may slide a window over some layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from dew.nn.hf.causal_lm import CausalLMFormat
from dew.nn.hf.fields import ConfigFields, read_rope, write_rope
from dew.nn.hf.layout import (
    Layout,
    Tensor,
    heads_bias,
    heads_in,
    heads_out,
    linear,
    lm_head,
    same,
)

_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768}


class LlamaFormat(CausalLMFormat):
    """A Llama-like family: ``'llama'``, ``'mistral'`` or ``'qwen2'``."""

    def __init__(self, family: str, architecture: str):
        if family not in _DEFAULT_MAX_POSITIONS:
            raise ValueError(
                f"LlamaFormat covers {', '.join(_DEFAULT_MAX_POSITIONS)}, not {family!r}"
            )
        self.family, self.architecture = family, architecture

    def read_options(self, fields: ConfigFields) -> dict[str, Any]:
        options = llama_options(fields, _DEFAULT_MAX_POSITIONS[self.family])
        options["mlp_features"] = fields.count("intermediate_size")
        if self.family == "llama":
            fields.expect("attention_bias", (False,), False)
            fields.expect("mlp_bias", (False,), False)
        if self.family == "mistral":
            options["sliding_window"] = fields.get("sliding_window", 4096)
        if self.family == "qwen2":
            options["use_qkv_bias"] = True
            options["sliding_window"] = qwen2_window(fields, options["num_layers"])
        return options

    def requirements(self, model) -> list[tuple[str, str, bool]]:
        qwen2 = self.family == "qwen2"
        needs = [
            *llama_requirements(model),
            ("use_qkv_bias", str(qwen2), model.use_qkv_bias == qwen2),
            ("num_experts", "0", model.num_experts == 0),
            ("qk_norm", "False", not model.qk_norm),
        ]
        if self.family == "llama":
            needs.append(("sliding_window", "None", model.sliding_window is None))
        return needs

    def write_config(self, model, config: dict[str, Any]) -> None:
        write_llama_config(model, config)
        config["intermediate_size"] = model.mlp_features
        if self.family == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        elif self.family == "mistral":
            config["sliding_window"] = model.sliding_window
        else:  # qwen2: one window over every layer, or none
            config.update(qwen2_window_fields(model.sliding_window, model.num_layers))

    def layout(self, model) -> Layout:
        return llama_layout(model, dense_mlp(model.mlp_features, model.emb_features))


def llama_layout(
    model, mlp: list[Tensor], *, mlp_of: Callable[[int], list[Tensor]] | None = None
) -> Layout:
    """The Llama layout with the feed-forward tensors ``mlp`` (relative to the layer):
    embeddings, norms, attention (q/k/v biases when ``use_qkv_bias``, q/k norms when
    ``qk_norm``) and the untied head. ``mlp_of``: layer ``i``'s feed-forward
    tensors when the layers differ (dense and expert layers), else None."""
    e, h, kv = model.emb_features, model.num_heads, model.kv_heads
    d, v = model.head_dim or e // h, model.vocab_size
    per_layer = [
        same("input_layernorm.weight", "attention_norm/scale", (e,)),
        heads_in("self_attn.q_proj.weight", "attention/query_kernel", h, d, e),
        heads_in("self_attn.k_proj.weight", "attention/key_kernel", kv, d, e),
        heads_in("self_attn.v_proj.weight", "attention/value_kernel", kv, d, e),
        heads_out("self_attn.o_proj.weight", "attention/out_kernel", h, d, e, transposed=True),
        same("post_attention_layernorm.weight", "mlp_norm/scale", (e,)),
    ]
    if model.use_qkv_bias:
        per_layer += [
            heads_bias("self_attn.q_proj.bias", "attention/query_bias", h, d),
            heads_bias("self_attn.k_proj.bias", "attention/key_bias", kv, d),
            heads_bias("self_attn.v_proj.bias", "attention/value_bias", kv, d),
        ]
    if getattr(model, "qk_norm", False):
        per_layer += [
            same("self_attn.q_norm.weight", "attention/query_norm/scale", (d,)),
            same("self_attn.k_norm.weight", "attention/key_norm/scale", (d,)),
        ]
    return Layout(
        prefix="model.",
        layer="layers.{i}.",
        globals=(
            same("embed_tokens.weight", "embed/embedding", (v, e)),
            same("norm.weight", "final_norm/scale", (e,)),
        ),
        per_layer=(*per_layer, *mlp),
        lm_head=lm_head(v, e, tied=model.tie_embeddings),
        buffers=re.compile(r"\.rotary_emb\.inv_freq$"),
        layer_tensors=None if mlp_of is None else (lambda i: (*per_layer, *mlp_of(i))),
    )


def llama_options(fields: ConfigFields, max_positions: int) -> dict[str, Any]:
    """The ``CausalTransformer`` options every Llama-like family reads the same way
    (widths, heads, ``head_dim`` when the config sets one, positions, RoPE, the
    RMSNorm, tied embeddings); ``max_positions``: the family's default
    ``max_position_embeddings``. The feed-forward width is the family's own."""
    emb = fields.count("hidden_size")
    heads = fields.count("num_attention_heads")
    head_dim = fields.count("head_dim", None, optional=True) or emb // heads
    fields.expect("hidden_act", ("silu", "swish"), "silu")
    theta, scaling = read_rope(fields)
    return dict(
        vocab_size=fields.count("vocab_size"),
        emb_features=emb,
        num_layers=fields.count("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=fields.count("num_key_value_heads", None, optional=True) or heads,
        head_dim=None if head_dim * heads == emb else head_dim,
        max_seq_len=fields.count("max_position_embeddings", max_positions),
        mlp_activation="swiglu",
        norm="rms",
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
        position_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
    )


def llama_requirements(model) -> list[tuple[str, str, bool]]:
    """The options every Llama-like checkpoint needs (RMSNorm, RoPE, SwiGLU, no biases
    on the dense layers)."""
    return [
        ("norm", "'rms'", model.norm == "rms"),
        ("position_embedding", "'rope'", model.position_embedding == "rope"),
        ("mlp_activation", "'swiglu'", model.mlp_activation == "swiglu"),
        ("use_bias", "False", not model.use_bias),
    ]


def write_llama_config(model, config: dict[str, Any]) -> None:
    """Set the config fields :func:`llama_options` reads (not the feed-forward width)."""
    config.update(
        hidden_size=model.emb_features,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.head_dim or model.emb_features // model.num_heads,
        hidden_act="silu",
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        **write_rope(model.rope_theta, model.rope_scaling),
    )


def dense_mlp(features: int, embed: int, block: str = "mlp.", path: str = "mlp") -> list[Tensor]:
    """A SwiGLU MLP's tensors: ``{block}gate_proj``, ``up_proj``, ``down_proj`` <->
    ``{path}/gate/kernel``, ``up``, ``down``."""
    return [
        linear(f"{block}gate_proj.weight", f"{path}/gate/kernel", features, embed),
        linear(f"{block}up_proj.weight", f"{path}/up/kernel", features, embed),
        linear(f"{block}down_proj.weight", f"{path}/down/kernel", embed, features),
    ]


def qwen2_window(fields: ConfigFields, num_layers: int) -> int | None:
    """Qwen2 slides its window over layers >= max_window_layers when use_sliding_window."""
    window = fields.get("sliding_window", 4096)
    used = fields.get("use_sliding_window", False) and window is not None
    first = fields.get("max_window_layers", 28)
    kinds = fields.get("layer_types", None)  # transformers 5 spells it out per layer
    if kinds is None:
        kinds = [
            "sliding_attention" if used and i >= first else "full_attention"
            for i in range(num_layers)
        ]
    sliding = [k == "sliding_attention" and used for k in kinds]
    if all(sliding):
        return int(window)
    if not any(sliding):
        return None
    raise ValueError(
        f"{fields.where}: config.json slides the attention window over only some layers "
        f"(layer_types {kinds}); Dew's CausalTransformer uses one window for all layers"
    )


def qwen2_window_fields(window: int | None, num_layers: int) -> dict[str, Any]:
    """Qwen2's window fields for one window over every layer (None: none)."""
    return dict(
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=0 if window is not None else num_layers,
        layer_types=["sliding_attention" if window is not None else "full_attention"] * num_layers,
    )


LLAMA = LlamaFormat("llama", "LlamaForCausalLM")
MISTRAL = LlamaFormat("mistral", "MistralForCausalLM")
QWEN2 = LlamaFormat("qwen2", "Qwen2ForCausalLM")
