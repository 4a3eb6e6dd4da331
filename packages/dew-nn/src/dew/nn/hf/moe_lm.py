"""Mixtral, Qwen2-MoE and Qwen3-MoE: Llama-like decoders whose feed-forward block
is a routed mixture of experts (:class:`dew.nn.moe.MoE` in every layer).

- ``mixtral``: softmax over the experts, the top k renormalised to sum 1;
  experts are ``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up), ``w2``
  (down); an attention window over every layer or none.
- ``qwen2_moe``: the top k of the softmax *not* renormalised unless
  ``norm_topk_prob``; a shared expert every token goes through, scaled by
  ``sigmoid(x w)`` (``mlp.shared_expert``, ``mlp.shared_expert_gate``); q/k/v
  biases (``qkv_bias``).
- ``qwen3_moe``: Qwen2-MoE's routing without the shared expert, an RMSNorm over
  each head's queries and keys (``q_norm``, ``k_norm``) and ``head_dim`` from the config.

Checkpoints keep one tensor per expert (``mlp.experts.{j}.gate_proj.weight``,
...), which is what Dew writes; the fused form transformers 5 holds in memory
(``mlp.experts.gate_up_proj [expert, 2 * moe_features, embed]``, ``down_proj``)
is read too. The config is read defensively: ``head_dim: null`` (Mixtral),
the expert count as ``num_local_experts`` or ``num_experts``, the expert width
as ``intermediate_size`` (Mixtral) or ``moe_intermediate_size`` (Qwen); a
routing variant Dew does not compute (group-limited top-k, a scoring function
other than softmax, a routed scaling factor, router jitter, dense layers
between the sparse ones by ``mlp_only_layers`` / ``decoder_sparse_step``) is an
error naming the field and its value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dew.nn.hf.causal_lm import CausalLMFormat
from dew.nn.hf.fields import ConfigFields, read_rope, write_rope
from dew.nn.hf.layout import Layout, Tensor, experts, fused_experts, linear
from dew.nn.hf.llama import llama_layout, qwen2_window, qwen2_window_fields

_DEFAULT_MAX_POSITIONS = {"mixtral": 4096 * 32, "qwen2_moe": 32768, "qwen3_moe": 32768}
# the key each family's config.json names its expert count with (both are read)
_EXPERTS_KEY = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
}
_EXPERTS_KEYS = ("num_local_experts", "num_experts")
# routing variants of other MoE families: the one value Dew computes
_ROUTING_VARIANTS = {
    "scoring_func": ("softmax",),
    "topk_method": ("greedy",),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (1, 1.0),
    "router_jitter_noise": (0, 0.0),
    "moe_layer_freq": (1,),
    "first_k_dense_replace": (0,),
    "n_shared_experts": (None, 0),
}
_FUSED = re.compile(r"\.experts\.gate_up_proj$")


class MoEFormat(CausalLMFormat):
    """A Llama-like family with routed experts: ``'mixtral'``, ``'qwen2_moe'`` or
    ``'qwen3_moe'``."""

    def __init__(self, family: str, architecture: str):
        if family not in _DEFAULT_MAX_POSITIONS:
            raise ValueError(
                f"MoEFormat covers {', '.join(_DEFAULT_MAX_POSITIONS)}, not {family!r}"
            )
        self.family, self.architecture = family, architecture

    @property
    def qwen(self) -> bool:
        return self.family != "mixtral"

    # --------------------------------------------------------------- config.json

    def read_options(self, fields: ConfigFields) -> dict[str, Any]:
        emb = fields.count("hidden_size")
        heads = fields.count("num_attention_heads")
        head_dim = fields.count("head_dim", None, optional=True) or emb // heads
        layers = fields.count("num_hidden_layers")
        fields.expect("hidden_act", ("silu", "swish"), "silu")
        theta, scaling = read_rope(fields)
        num_experts = _expert_count(fields, self.family)
        k = fields.count("num_experts_per_tok", 2)
        if k > num_experts:
            raise ValueError(
                f"{fields.where}: config.json sets num_experts_per_tok={k}, more than the "
                f"{num_experts} experts; fix the field (at most the expert count)"
            )
        for name, allowed in _ROUTING_VARIANTS.items():
            if name in fields.config:
                fields.expect(name, allowed, allowed[0])
        _check_every_layer_sparse(fields, layers)
        for name in ("router_aux_loss_coef", "output_router_logits"):  # training settings
            fields.get(name, None)
        options = dict(
            vocab_size=fields.count("vocab_size"),
            emb_features=emb,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=fields.count("num_key_value_heads", None, optional=True) or heads,
            head_dim=None if head_dim * heads == emb else head_dim,
            max_seq_len=fields.count(
                "max_position_embeddings", _DEFAULT_MAX_POSITIONS[self.family]
            ),
            mlp_activation="swiglu",
            norm="rms",
            norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
            position_embedding="rope",
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
            num_experts=num_experts,
            experts_per_token=k,
        )
        if self.family == "mixtral":
            options.update(
                mlp_features=fields.count("intermediate_size"),
                sliding_window=fields.count("sliding_window", None, optional=True),
                moe_norm_topk_prob=True,
            )
            return options
        fields.count("intermediate_size", None, optional=True)  # the dense layers' width: none
        options.update(
            mlp_features=fields.count("moe_intermediate_size"),
            moe_norm_topk_prob=bool(fields.expect("norm_topk_prob", (False, True), False)),
        )
        if self.family == "qwen2_moe":
            options.update(
                use_qkv_bias=bool(fields.expect("qkv_bias", (True, False), True)),
                sliding_window=qwen2_window(fields, layers),
                moe_shared_features=fields.count("shared_expert_intermediate_size"),
            )
        else:
            fields.expect("attention_bias", (False,), False)
            used = fields.get("use_sliding_window", False)
            window = fields.get("sliding_window", None)
            fields.get("max_window_layers", None)  # transformers slides every layer's window
            options.update(qk_norm=True, sliding_window=window if used else None)
        return options

    def requirements(self, model) -> list[tuple[str, str, bool]]:
        normalised = (
            model.moe_gating == "topk_softmax"
            or model.moe_norm_topk_prob
            or (model.moe_norm_topk_prob is None and model.experts_per_token > 1)
        )
        shared, qk_norm = self.family == "qwen2_moe", self.family == "qwen3_moe"
        has_shared = model.moe_shared_features > 0
        needs = [
            ("norm", "'rms'", model.norm == "rms"),
            ("position_embedding", "'rope'", model.position_embedding == "rope"),
            ("mlp_activation", "'swiglu'", model.mlp_activation == "swiglu"),
            ("use_bias", "False", not model.use_bias),
            ("num_experts", ">= 1", model.num_experts >= 1),
            ("qk_norm", str(qk_norm), model.qk_norm == qk_norm),
            ("moe_shared_features", "> 0" if shared else "0", has_shared == shared),
        ]
        if shared:
            needs.append(("moe_shared_gate", "True", model.moe_shared_gate))
        else:
            needs.append(("use_qkv_bias", "False", not model.use_qkv_bias))
        if self.family == "mixtral":
            needs.append(("moe_norm_topk_prob", "True (renormalised top k)", normalised))
        return needs

    def write_config(self, model, config: dict[str, Any]) -> None:
        key = next((k for k in _EXPERTS_KEYS if k in config), _EXPERTS_KEY[self.family])
        for other in _EXPERTS_KEYS:
            config.pop(other, None)
        config.update(
            hidden_size=model.emb_features,
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads,
            num_key_value_heads=model.kv_heads,
            head_dim=model.head_dim or model.emb_features // model.num_heads,
            hidden_act="silu",
            max_position_embeddings=model.max_seq_len,
            rms_norm_eps=model.norm_eps,
            num_experts_per_tok=model.experts_per_token,
            **{key: model.num_experts},
            **write_rope(model.rope_theta, model.rope_scaling),
        )
        if self.family == "mixtral":
            config.update(intermediate_size=model.mlp_features, sliding_window=model.sliding_window)
            return
        normalised = model.moe_gating == "topk_softmax" or bool(
            model.moe_norm_topk_prob
            if model.moe_norm_topk_prob is not None
            else model.experts_per_token > 1
        )
        config.setdefault("intermediate_size", model.mlp_features)  # dense layers: none
        config.update(
            moe_intermediate_size=model.mlp_features,
            norm_topk_prob=normalised,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        if self.family == "qwen2_moe":
            config.update(
                qkv_bias=model.use_qkv_bias,
                shared_expert_intermediate_size=model.moe_shared_features,
                **qwen2_window_fields(model.sliding_window, model.num_layers),
            )
        else:
            window = model.sliding_window
            config.update(
                attention_bias=False, use_sliding_window=window is not None, sliding_window=window
            )

    # --------------------------------------------------------------- tensors

    def layout(self, model, *, block: str | None = None) -> Layout:
        """One tensor per expert (the hub's layout); ``block``: the MoE block's
        name (Mixtral's ``block_sparse_moe.``, else ``mlp.``)."""
        e, f, n = model.emb_features, model.mlp_features, model.num_experts
        if self.qwen:
            block = block or "mlp."
            names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        else:
            block = block or "block_sparse_moe."
            names = {"gate": "w1", "up": "w3", "down": "w2"}
        mlp = [
            linear(f"{block}gate.weight", "mlp/router", n, e),
            experts(f"{block}experts.{{j}}.{names['gate']}.weight", "mlp/gate", n, f, e),
            experts(f"{block}experts.{{j}}.{names['up']}.weight", "mlp/up", n, f, e),
            experts(f"{block}experts.{{j}}.{names['down']}.weight", "mlp/down", n, e, f),
        ]
        return llama_layout(model, mlp + self._shared(model, block))

    def fused_layout(self, model) -> Layout:
        """transformers 5's in-memory layout: ``mlp.experts.gate_up_proj`` and
        ``mlp.experts.down_proj``, one tensor for all experts (read only)."""
        e, f, n = model.emb_features, model.mlp_features, model.num_experts
        mlp = [
            linear("mlp.gate.weight", "mlp/router", n, e),
            fused_experts("mlp.experts.gate_up_proj", ("mlp/gate", "mlp/up"), n, f, e),
            fused_experts("mlp.experts.down_proj", ("mlp/down",), n, e, f),
        ]
        return llama_layout(model, mlp + self._shared(model, "mlp."))

    def read_layout_of(self, model, tensors: Mapping[str, Any]) -> Layout:
        names = list(tensors.keys())
        if any(_FUSED.search(n) for n in names):
            return self.fused_layout(model)
        if not self.qwen and not any(".block_sparse_moe." in n for n in names):
            return self.layout(model, block="mlp.")  # renamed as transformers 5 does
        return self.layout(model)

    def _shared(self, model, block: str) -> list[Tensor]:
        s, e = model.moe_shared_features, model.emb_features
        if not s:
            return []
        return [
            linear(f"{block}shared_expert.gate_proj.weight", "mlp/shared_expert/gate/kernel", s, e),
            linear(f"{block}shared_expert.up_proj.weight", "mlp/shared_expert/up/kernel", s, e),
            linear(f"{block}shared_expert.down_proj.weight", "mlp/shared_expert/down/kernel", e, s),
            linear(f"{block}shared_expert_gate.weight", "mlp/shared_expert_gate", 1, e),
        ]


def _expert_count(fields: ConfigFields, family: str) -> int:
    """The expert count, from ``num_local_experts`` or ``num_experts`` (transformers
    spells it either way by family and version); both given must agree."""
    given = {k: fields.count(k) for k in _EXPERTS_KEYS if k in fields.config}
    if not given:
        fields.get(_EXPERTS_KEY[family])  # raises: names the field a checkpoint needs
    if len(set(given.values())) > 1:
        raise ValueError(
            f"{fields.where}: config.json sets num_local_experts={given['num_local_experts']} "
            f"and num_experts={given['num_experts']}; they name the same count: fix one"
        )
    return next(iter(given.values()))


def _check_every_layer_sparse(fields: ConfigFields, layers: int) -> None:
    """Raise unless ``mlp_only_layers`` and ``decoder_sparse_step`` put experts in
    every layer, as transformers picks them: layer ``i`` is sparse when ``i`` is
    not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
    only = fields.get("mlp_only_layers", None) or []
    step = fields.count("decoder_sparse_step", 1)
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense:
        raise ValueError(
            f"{fields.where}: config.json sets mlp_only_layers={list(only)!r} and "
            f"decoder_sparse_step={step}, so layers {dense} use a dense MLP between the "
            f"expert layers; Dew's CausalTransformer runs the same block in every layer and "
            f"loads only checkpoints with experts in all of them (mlp_only_layers=[], "
            f"decoder_sparse_step=1)"
        )


MIXTRAL = MoEFormat("mixtral", "MixtralForCausalLM")
QWEN2_MOE = MoEFormat("qwen2_moe", "Qwen2MoeForCausalLM")
QWEN3_MOE = MoEFormat("qwen3_moe", "Qwen3MoeForCausalLM")
