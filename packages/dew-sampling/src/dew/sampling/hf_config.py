"""Hugging Face ``config.json`` <-> :class:`dew.nn.CausalTransformer` options.

Four families load: Llama (grouped-query attention, rope scaling ``linear``
and ``llama3``), Mistral (sliding-window attention), Qwen2 (q/k/v biases)
and GPT-2 (learned positions, LayerNorm, GELU, biases, tied embeddings).
Both ways of writing rotary settings load: transformers 4's top-level
``rope_theta`` + ``rope_scaling`` and transformers 5's ``rope_parameters``.

Every field of ``config.json`` is either read, checked, or ignored:

- read: the sizes, norms, rotary settings, sliding window and tying, which
  become :class:`CausalTransformer` options;
- checked: fields whose other values change the computation Dew does not
  have (e.g. Llama's ``attention_bias``, GPT-2's ``scale_attn_by_inverse_layer_idx``);
  an unsupported value is an error that names the field;
- ignored: :data:`IGNORED_FIELDS`, which do not change the forward pass
  (token ids, dropout rates, initialiser ranges, bookkeeping, generation defaults);
- anything else is an error that names it: a field Dew does not know may
  change the architecture. Pass ``ignore_fields=`` to
  :meth:`dew.sampling.Pretrained.load` once you know it does not.
"""

from __future__ import annotations

from typing import Any

from dew.nn.rope import RopeScaling

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}

# Fields that do not change the forward pass of the model.
IGNORED_FIELDS = frozenset(
    {
        # bookkeeping
        "architectures", "model_type", "transformers_version", "_name_or_path", "name_or_path",
        "dtype", "torch_dtype", "use_bfloat16", "_commit_hash", "_attn_implementation",
        "attn_implementation", "_attn_implementation_autoset", "tokenizer_class", "prefix",
        "finetuning_task", "id2label", "label2id", "num_labels", "problem_type",
        "task_specific_params", "torchscript", "return_dict", "use_return_dict",
        "output_attentions", "output_hidden_states", "pruned_heads", "chunk_size_feed_forward",
        "is_encoder_decoder", "is_decoder", "tie_encoder_decoder", "tf_legacy_loss",
        "cross_attention_hidden_size",
        # special token ids (the tokenizer's business)
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        # training-only settings
        "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "resid_pdrop",
        "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj", "summary_activation",
        "summary_proj_to_labels", "summary_first_dropout",
        # numerically equivalent variants of the same computation
        "pretraining_tp", "reorder_and_upcast_attn", "n_ctx",
        # generation defaults that transformers 4 kept in config.json
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    }
)  # fmt: skip

GPT2_ACTIVATIONS = {
    "gelu_new": "gelu",  # tanh approximation
    "gelu_pytorch_tanh": "gelu",
    "gelu_fast": "gelu",
    "gelu": "gelu_exact",  # erf form
    "relu": "relu",
}
ROPE_KINDS = ("default", "linear", "llama3")
_MISSING = object()


class _Fields:
    """Reads ``config.json`` fields and remembers which ones it used."""

    def __init__(self, config: dict[str, Any], family: str, where: str):
        self.config, self.family, self.where, self.used = config, family, where, set()

    def get(self, name: str, default: Any = _MISSING) -> Any:
        self.used.add(name)
        value = self.config.get(name, default)
        if value is _MISSING:
            raise ValueError(
                f"{self.where}: config.json lacks {name!r}, which a {self.family} checkpoint needs"
            )
        return value

    def expect(self, name: str, allowed: tuple, default: Any) -> Any:
        value = self.get(name, default)
        if value not in allowed:
            raise ValueError(
                f"{self.where}: config.json sets {name}={value!r}, which changes the "
                f"{self.family} architecture in a way Dew's CausalTransformer does not support "
                f"(supported: {', '.join(repr(a) for a in allowed)})"
            )
        return value

    def check_unknown(self, ignore_fields) -> None:
        unknown = sorted(set(self.config) - self.used - IGNORED_FIELDS - set(ignore_fields))
        if unknown:
            raise ValueError(
                f"{self.where}: config.json has field(s) {unknown} that Dew's {self.family} "
                f"loader does not know; they may change the architecture. If they do not, "
                f"load with Pretrained.load(path, ignore_fields={tuple(unknown)!r})"
            )


def family_of(config: dict[str, Any], where: str) -> str:
    """The family (``model_type``) of ``config``; an unsupported one lists the supported."""
    model_type = config.get("model_type")
    if model_type is None:  # very old checkpoints name only the class
        by_class = {cls: family for family, cls in SUPPORTED.items()}
        model_type = next(
            (by_class[a] for a in config.get("architectures", ()) if a in by_class), None
        )
    if model_type not in SUPPORTED:
        supported = ", ".join(f"{f} ({c})" for f, c in SUPPORTED.items())
        raise ValueError(
            f"{where}: architecture model_type={config.get('model_type')!r} "
            f"(architectures {config.get('architectures')}) is not supported; Dew loads "
            f"{supported}"
        )
    return model_type


def _rope(fields: _Fields) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the transformers 4 or the 5 form."""
    # As transformers 5 reads them: a non-empty rope_scaling (the 4 form) wins
    # over rope_parameters (the 5 form); rope_theta inside either wins over the
    # top-level one.
    legacy = fields.get("rope_scaling", None)
    parameters = fields.get("rope_parameters", None)
    spec = dict(legacy or parameters or {})
    top_level_theta = fields.get("rope_theta", None)  # transformers 4
    theta = spec.pop("rope_theta", None) or top_level_theta or 10000.0
    kind = spec.pop("rope_type", None) or spec.pop("type", None) or "default"
    spec.pop("type", None)
    if spec.get("partial_rotary_factor", 1.0) == 1.0:
        spec.pop("partial_rotary_factor", None)
    if spec.get("attention_factor") in (None, 1.0):
        spec.pop("attention_factor", None)
    where = f"{fields.where}: config.json rope settings"
    if kind not in ROPE_KINDS:
        raise ValueError(
            f"{where}: rope_type {kind!r} is not supported; Dew supports {', '.join(ROPE_KINDS)}"
        )
    keys = {
        "default": (),
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }[kind]
    if kind == "default":
        spec.pop("factor", None)  # some writers leave factor=1.0 beside rope_type 'default'
    unknown = sorted(set(spec) - set(keys))
    missing = sorted(set(keys) - set(spec))
    if unknown or missing:
        raise ValueError(
            f"{where} for rope_type {kind!r}: unknown keys {unknown}, missing keys "
            f"{missing} (expected {list(keys)})"
        )
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling(kind="linear", factor=float(spec["factor"]))
    return float(theta), RopeScaling(
        kind="llama3",
        factor=float(spec["factor"]),
        low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position=int(spec["original_max_position_embeddings"]),
    )


def _llama_like(fields: _Fields, family: str) -> dict[str, Any]:
    emb = fields.get("hidden_size")
    heads = fields.get("num_attention_heads")
    head_dim = fields.get("head_dim", None) or emb // heads
    fields.expect("hidden_act", ("silu", "swish"), "silu")
    theta, scaling = _rope(fields)
    options = dict(
        vocab_size=fields.get("vocab_size"),
        emb_features=emb,
        num_layers=fields.get("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=fields.get("num_key_value_heads", None) or heads,
        head_dim=None if head_dim * heads == emb else head_dim,
        mlp_features=fields.get("intermediate_size"),
        max_seq_len=fields.get(
            "max_position_embeddings", {"llama": 2048, "mistral": 131072, "qwen2": 32768}[family]
        ),
        mlp_activation="swiglu",
        norm="rms",
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
        position_embedding="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
    )
    if family == "llama":
        fields.expect("attention_bias", (False,), False)
        fields.expect("mlp_bias", (False,), False)
    if family == "mistral":
        options["sliding_window"] = fields.get("sliding_window", 4096)
    if family == "qwen2":
        options["use_qkv_bias"] = True
        options["sliding_window"] = _qwen2_window(fields, options["num_layers"])
    return options


def _qwen2_window(fields: _Fields, num_layers: int) -> int | None:
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


def _gpt2(fields: _Fields) -> dict[str, Any]:
    emb = fields.get("n_embd")
    activation = fields.expect("activation_function", tuple(GPT2_ACTIVATIONS), "gelu_new")
    fields.expect("add_cross_attention", (False,), False)
    fields.expect("scale_attn_weights", (True,), True)
    fields.expect("scale_attn_by_inverse_layer_idx", (False,), False)
    return dict(
        vocab_size=fields.get("vocab_size"),
        emb_features=emb,
        num_layers=fields.get("n_layer"),
        num_heads=fields.get("n_head"),
        mlp_features=fields.get("n_inner", None) or 4 * emb,
        max_seq_len=fields.get("n_positions", 1024),
        mlp_activation=GPT2_ACTIVATIONS[activation],
        norm="layer",
        norm_eps=float(fields.get("layer_norm_epsilon", 1e-5)),
        position_embedding="learned",
        use_bias=True,
        tie_embeddings=bool(fields.get("tie_word_embeddings", True)),
    )


def to_options(
    config: dict[str, Any], family: str, *, where: str = "", ignore_fields=()
) -> dict[str, Any]:
    """:class:`CausalTransformer` options for a ``config.json`` of ``family``."""
    fields = _Fields(config, family, where or "checkpoint")
    options = _gpt2(fields) if family == "gpt2" else _llama_like(fields, family)
    fields.check_unknown(ignore_fields)
    return options


# ------------------------------------------------------------------ writing


def _requirements(model, family: str) -> list[tuple[str, Any, bool]]:
    """``(option, what family needs, whether the model has it)`` for each constrained option."""
    head_dim = model.head_dim or model.emb_features // model.num_heads
    if family == "gpt2":
        return [
            ("norm", "'layer'", model.norm == "layer"),
            ("position_embedding", "'learned'", model.position_embedding == "learned"),
            ("use_bias", "True", model.use_bias),
            (
                "mlp_activation",
                "'gelu', 'gelu_exact' or 'relu'",
                model.mlp_activation in ("gelu", "gelu_exact", "relu"),
            ),
            ("num_kv_heads", "num_heads", model.kv_heads == model.num_heads),
            (
                "head_dim",
                "emb_features // num_heads",
                head_dim * model.num_heads == model.emb_features,
            ),
            ("sliding_window", "None", model.sliding_window is None),
        ]
    needs = [
        ("norm", "'rms'", model.norm == "rms"),
        ("position_embedding", "'rope'", model.position_embedding == "rope"),
        ("mlp_activation", "'swiglu'", model.mlp_activation == "swiglu"),
        ("use_bias", "False", not model.use_bias),
        ("use_qkv_bias", str(family == "qwen2"), model.use_qkv_bias == (family == "qwen2")),
    ]
    if family == "llama":
        needs.append(("sliding_window", "None", model.sliding_window is None))
    return needs


def check_expressible(model, family: str) -> None:
    """Raise unless a ``family`` checkpoint can hold ``model`` exactly."""
    if family not in SUPPORTED:
        raise ValueError(
            f"unknown checkpoint format {family!r}; use 'dew' or one of {', '.join(SUPPORTED)}"
        )
    wrong = [(o, n) for o, n, ok in _requirements(model, family) if not ok]
    if wrong:
        needs = "; ".join(f"{o}={n} (the model has {getattr(model, o)!r})" for o, n in wrong)
        raise ValueError(
            f"a {family} checkpoint cannot hold this model: {family} needs {needs}. "
            f"Save it with format='dew' instead"
        )


def _rope_fields(model) -> dict[str, Any]:
    """Both transformers 4 (``rope_theta``, ``rope_scaling``) and 5 (``rope_parameters``) forms."""
    s = model.rope_scaling
    if s is None:
        scaling = None
    elif s.kind == "linear":
        scaling = {"rope_type": "linear", "factor": s.factor}
    else:
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": model.rope_theta}
    return {"rope_theta": model.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def to_config(
    model, family: str, *, base: dict[str, Any] | None = None, dtype_name: str = "float32"
) -> dict[str, Any]:
    """The ``config.json`` of ``model`` as a ``family`` checkpoint.

    base: the config the model was loaded from; its ignored fields (token ids,
      dropout, ...) are kept, the fields Dew reads are rewritten from ``model``.
    """
    check_expressible(model, family)
    config = dict(base or {})
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "torch_dtype"):
        config.pop(key, None)
    config.update(
        architectures=[SUPPORTED[family]],
        model_type=family,
        dtype=dtype_name,
        vocab_size=model.vocab_size,
        tie_word_embeddings=model.tie_embeddings,
    )
    head_dim = model.head_dim or model.emb_features // model.num_heads
    if family == "gpt2":
        activation = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
        config.update(
            n_embd=model.emb_features,
            n_layer=model.num_layers,
            n_head=model.num_heads,
            n_inner=model.mlp_features,
            n_positions=model.max_seq_len,
            layer_norm_epsilon=model.norm_eps,
            activation_function=activation[model.mlp_activation],
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
            add_cross_attention=False,
        )
        return config
    config.update(
        hidden_size=model.emb_features,
        intermediate_size=model.mlp_features,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        num_key_value_heads=model.kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        **_rope_fields(model),
    )
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        config["sliding_window"] = model.sliding_window
    else:  # qwen2: one window over every layer, or none
        window = model.sliding_window
        config.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=0 if window is not None else model.num_layers,
            layer_types=["sliding_attention" if window is not None else "full_attention"]
            * model.num_layers,
        )
    return config
