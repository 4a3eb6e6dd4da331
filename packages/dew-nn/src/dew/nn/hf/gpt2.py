"""GPT-2: learned positions, LayerNorm, GELU, biases everywhere, tied embeddings,
and a fused ``c_attn`` in ``Conv1D`` layout (``[in, out]``)."""

from __future__ import annotations

import re
from typing import Any

from dew.nn.hf.causal_lm import CausalLMFormat
from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layout import Layout, fused_qkv, heads_out, lm_head, same

# transformers' activation_function -> Dew's mlp_activation
ACTIVATIONS = {
    "gelu_new": "gelu",  # tanh approximation
    "gelu_pytorch_tanh": "gelu",
    "gelu_fast": "gelu",
    "gelu": "gelu_exact",  # erf form
    "relu": "relu",
}
_WRITTEN_ACTIVATIONS = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}


class GPT2Format(CausalLMFormat):
    """``GPT2LMHeadModel`` checkpoints."""

    family = "gpt2"
    architecture = "GPT2LMHeadModel"

    def read_options(self, fields: ConfigFields) -> dict[str, Any]:
        emb = fields.count("n_embd")
        activation = fields.expect("activation_function", tuple(ACTIVATIONS), "gelu_new")
        fields.expect("add_cross_attention", (False,), False)
        fields.expect("scale_attn_weights", (True,), True)
        fields.expect("scale_attn_by_inverse_layer_idx", (False,), False)
        return dict(
            vocab_size=fields.count("vocab_size"),
            emb_features=emb,
            num_layers=fields.count("n_layer"),
            num_heads=fields.count("n_head"),
            mlp_features=fields.count("n_inner", None, optional=True) or 4 * emb,
            max_seq_len=fields.count("n_positions", 1024),
            mlp_activation=ACTIVATIONS[activation],
            norm="layer",
            norm_eps=float(fields.get("layer_norm_epsilon", 1e-5)),
            position_embedding="learned",
            use_bias=True,
            tie_embeddings=bool(fields.get("tie_word_embeddings", True)),
        )

    def requirements(self, model) -> list[tuple[str, str, bool]]:
        head_dim = model.head_dim or model.emb_features // model.num_heads
        return [
            ("norm", "'layer'", model.norm == "layer"),
            ("position_embedding", "'learned'", model.position_embedding == "learned"),
            ("use_bias", "True", model.use_bias),
            (
                "mlp_activation",
                "'gelu', 'gelu_exact' or 'relu'",
                model.mlp_activation in _WRITTEN_ACTIVATIONS,
            ),
            ("num_kv_heads", "num_heads", model.kv_heads == model.num_heads),
            (
                "head_dim",
                "emb_features // num_heads",
                head_dim * model.num_heads == model.emb_features,
            ),
            ("sliding_window", "None", model.sliding_window is None),
            ("num_experts", "0", model.num_experts == 0),
        ]

    def write_config(self, model, config: dict[str, Any]) -> None:
        config.update(
            n_embd=model.emb_features,
            n_layer=model.num_layers,
            n_head=model.num_heads,
            n_inner=model.mlp_features,
            n_positions=model.max_seq_len,
            layer_norm_epsilon=model.norm_eps,
            activation_function=_WRITTEN_ACTIVATIONS[model.mlp_activation],
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            add_cross_attention=False,
        )

    def layout(self, model) -> Layout:
        e, h = model.emb_features, model.num_heads
        d, m, v = model.head_dim or e // h, model.mlp_features, model.vocab_size
        return Layout(
            prefix="transformer.",
            layer="h.{i}.",
            globals=(
                same("wte.weight", "embed/embedding", (v, e)),
                same("wpe.weight", "position_embed", (model.max_seq_len, e)),
                same("ln_f.weight", "final_norm/scale", (e,)),
                same("ln_f.bias", "final_norm/bias", (e,)),
            ),
            per_layer=(
                same("ln_1.weight", "attention_norm/scale", (e,)),
                same("ln_1.bias", "attention_norm/bias", (e,)),
                fused_qkv("attn.c_attn.weight", h, d, e, bias=False),
                fused_qkv("attn.c_attn.bias", h, d, e, bias=True),
                heads_out("attn.c_proj.weight", "attention/out_kernel", h, d, e, transposed=False),
                same("attn.c_proj.bias", "attention/out_bias", (e,)),
                same("ln_2.weight", "mlp_norm/scale", (e,)),
                same("ln_2.bias", "mlp_norm/bias", (e,)),
                same("mlp.c_fc.weight", "mlp/up/kernel", (e, m)),
                same("mlp.c_fc.bias", "mlp/up/bias", (m,)),
                same("mlp.c_proj.weight", "mlp/down/kernel", (m, e)),
                same("mlp.c_proj.bias", "mlp/down/bias", (e,)),
            ),
            lm_head=lm_head(v, e, tied=model.tie_embeddings),
            buffers=re.compile(r"\.attn\.(masked_)?bias$"),
        )


GPT2 = GPT2Format()
