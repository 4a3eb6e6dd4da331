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
other than softmax, a routed scaling factor, router jitter) is an error naming
the field and its value. Qwen's dense layers between the expert ones
(``mlp_only_layers``, ``decoder_sparse_step``) load as ``CausalTransformer(
moe_layers=..., dense_mlp_features=intermediate_size)``, whose layers then run
unrolled; Dew writes them back as ``mlp_only_layers`` with
``decoder_sparse_step=1``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dew.nn.hf.causal_lm import CausalLMFormat
from dew.nn.hf.fields import ConfigFields
from dew.nn.hf.layout import Layout, Tensor, experts, fused_experts, linear
from dew.nn.hf.llama import (
    dense_mlp,
    llama_layout,
    llama_options,
    llama_requirements,
    qwen2_window,
    qwen2_window_fields,
    write_llama_config,
)
from dew.nn.keywords import is_whole_number

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
        options = llama_options(fields, _DEFAULT_MAX_POSITIONS[self.family])
        layers = options["num_layers"]
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
        for name in ("router_aux_loss_coef", "output_router_logits"):  # training settings
            fields.get(name, None)
        options.update(num_experts=num_experts, experts_per_token=k)
        sparse = _sparse_layers(fields, layers)
        if self.family == "mixtral":
            if len(sparse) < layers:
                raise ValueError(
                    f"{fields.where}: config.json puts dense layers between the expert ones "
                    f"(experts only in layers {list(sparse)}), which Mixtral does not have; "
                    "drop mlp_only_layers and decoder_sparse_step, or save it as Qwen2-MoE"
                )
            options.update(
                mlp_features=fields.count("intermediate_size"),
                sliding_window=fields.count("sliding_window", None, optional=True),
                moe_norm_topk_prob=True,
            )
            return options
        options.update(
            mlp_features=fields.count("moe_intermediate_size"),
            moe_norm_topk_prob=bool(fields.expect("norm_topk_prob", (False, True), False)),
        )
        dense_width = fields.count("intermediate_size", None, optional=True)
        if len(sparse) < layers:  # dense MLPs of width intermediate_size between them
            if dense_width is None:
                raise ValueError(
                    f"{fields.where}: config.json puts dense layers between the expert ones "
                    f"(experts only in layers {list(sparse)}) but sets no intermediate_size, "
                    "their MLP's width; set it"
                )
            options.update(moe_layers=sparse, dense_mlp_features=dense_width)
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
            *llama_requirements(model),
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
            mixed = getattr(model, "is_mixed", False)
            needs.append(("moe_layers", "None (experts in every layer)", not mixed))
        return needs

    def write_config(self, model, config: dict[str, Any]) -> None:
        key = next((k for k in _EXPERTS_KEYS if k in config), _EXPERTS_KEY[self.family])
        for other in _EXPERTS_KEYS:
            config.pop(other, None)
        write_llama_config(model, config)
        config.update(num_experts_per_tok=model.experts_per_token, **{key: model.num_experts})
        if self.family == "mixtral":
            config.update(intermediate_size=model.mlp_features, sliding_window=model.sliding_window)
            return
        normalised = model.moe_gating == "topk_softmax" or bool(
            model.moe_norm_topk_prob
            if model.moe_norm_topk_prob is not None
            else model.experts_per_token > 1
        )
        dense = [i for i in range(model.num_layers) if i not in _moe_layers(model)]
        if dense:
            config["intermediate_size"] = model.dense_mlp_features or model.mlp_features
        else:
            config.setdefault("intermediate_size", model.mlp_features)  # dense layers: none
        config.update(
            moe_intermediate_size=model.mlp_features,
            norm_topk_prob=normalised,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
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
        return self._layers(model, mlp + self._shared(model, block))

    def fused_layout(self, model) -> Layout:
        """transformers 5's in-memory layout: ``mlp.experts.gate_up_proj`` and
        ``mlp.experts.down_proj``, one tensor for all experts (read only)."""
        e, f, n = model.emb_features, model.mlp_features, model.num_experts
        mlp = [
            linear("mlp.gate.weight", "mlp/router", n, e),
            fused_experts("mlp.experts.gate_up_proj", ("mlp/gate", "mlp/up"), n, f, e),
            fused_experts("mlp.experts.down_proj", ("mlp/down",), n, e, f),
        ]
        return self._layers(model, mlp + self._shared(model, "mlp."))

    def _layers(self, model, moe: list[Tensor]) -> Layout:
        """:func:`llama_layout` with the expert tensors ``moe`` in the MoE layers and a
        dense MLP (``mlp.gate_proj``, ...) in the others."""
        if not getattr(model, "is_mixed", False):
            return llama_layout(model, moe)
        sparse = set(_moe_layers(model))
        dense = dense_mlp(model.dense_mlp_features or model.mlp_features, model.emb_features)
        return llama_layout(model, moe, mlp_of=lambda i: moe if i in sparse else dense)

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


def _sparse_layers(fields: ConfigFields, layers: int) -> tuple[int, ...]:
    """The expert layers as transformers picks them: layer ``i`` is sparse when ``i``
    is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
    only = fields.get("mlp_only_layers", None) or []
    step = fields.count("decoder_sparse_step", 1)
    if not isinstance(only, list | tuple) or any(
        not is_whole_number(i) or not 0 <= i < layers for i in only
    ):
        raise ValueError(
            f"{fields.where}: config.json sets mlp_only_layers={only!r}; it must list layer "
            f"indices in 0...{layers - 1} (the layers with a dense MLP)"
        )
    sparse = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    if not sparse:
        raise ValueError(
            f"{fields.where}: config.json sets mlp_only_layers={list(only)!r} and "
            f"decoder_sparse_step={step}, which leave no expert layer among the {layers}; "
            "a model without experts is a dense one: load it as its dense family"
        )
    return sparse


def _moe_layers(model) -> tuple[int, ...]:
    """The model's expert layers (every layer unless ``moe_layers`` says otherwise)."""
    chosen = getattr(model, "moe_layers", None)
    return tuple(range(model.num_layers)) if chosen is None else tuple(chosen)


MIXTRAL = MoEFormat("mixtral", "MixtralForCausalLM")
QWEN2_MOE = MoEFormat("qwen2_moe", "Qwen2MoeForCausalLM")
QWEN3_MOE = MoEFormat("qwen3_moe", "Qwen3MoeForCausalLM")
