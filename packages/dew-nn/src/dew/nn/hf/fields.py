"""Reading a Hugging Face ``config.json``: every field is read, checked, or ignored.

- read: a family's sizes, norms, rotary settings, ... which become Dew options;
- checked: fields whose other values change the computation in a way the
  Dew backbone does not have (e.g. Llama's ``attention_bias``); an
  unsupported value is an error that names the field;
- ignored: :data:`IGNORED_FIELDS`, which do not change the forward pass
  (token ids, dropout rates, initialiser ranges, bookkeeping, generation defaults);
- anything else is an error that names it: a field Dew does not know may
  change the architecture. ``ignore_fields=`` lets a caller who knows better
  pass it.

Rotary settings come in two spellings, both read here: transformers 4's
top-level ``rope_theta`` + ``rope_scaling`` and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dew.nn.keywords import is_whole_number
from dew.nn.rope import RopeScaling

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

ROPE_KINDS = ("default", "linear", "llama3")
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_MISSING = object()


class ConfigFields:
    """Reads the fields of one ``config.json`` and remembers which ones were used.

    config: the parsed ``config.json``.
    family: the family reading it (for messages), e.g. ``'llama'``.
    where: where the config came from (a directory), for messages.
    """

    def __init__(self, config: Mapping[str, Any], family: str, where: str = ""):
        self.config, self.family, self.where = dict(config), family, where or "checkpoint"
        self.used: set[str] = set()

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """The field's value; without ``default`` a missing field is an error."""
        self.used.add(name)
        value = self.config.get(name, default)
        if value is _MISSING:
            raise ValueError(
                f"{self.where}: config.json lacks {name!r}, which a {self.family} checkpoint needs"
            )
        return value

    def count(self, name: str, default: Any = _MISSING, *, optional: bool = False) -> Any:
        """The field's value, which must be a whole number >= 1 (a size, a head or
        layer count); ``optional``: None (or a missing field with default None) passes."""
        value = self.get(name, default)
        if value is None and optional:
            return None
        if not is_whole_number(value) or value < 1:
            raise ValueError(
                f"{self.where}: config.json sets {name}={value!r}, but a {self.family} "
                f"checkpoint needs a whole number >= 1 there"
                + (" (or null)" if optional else "")
                + "; the file is damaged or describes another model: fix the field or "
                "download the checkpoint again"
            )
        return value

    def expect(self, name: str, allowed: tuple, default: Any) -> Any:
        """The field's value, which must be one of ``allowed`` (values Dew computes)."""
        value = self.get(name, default)
        if value not in allowed:
            raise ValueError(
                f"{self.where}: config.json sets {name}={value!r}, which changes the "
                f"{self.family} architecture in a way Dew does not support "
                f"(supported: {', '.join(repr(a) for a in allowed)})"
            )
        return value

    def check_unknown(self, ignore_fields: Iterable[str] = ()) -> None:
        """Raise when a field was neither read nor known to be harmless."""
        unknown = sorted(set(self.config) - self.used - IGNORED_FIELDS - set(ignore_fields))
        if unknown:
            raise ValueError(
                f"{self.where}: config.json has field(s) {unknown} that Dew's {self.family} "
                f"format does not know; they may change the architecture. If they do not, "
                f"load with Pretrained.load(path, ignore_fields={tuple(unknown)!r})"
            )


def read_rope(fields: ConfigFields) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` from either the transformers 4 or the 5 form.

    As transformers 5 reads them: a non-empty ``rope_scaling`` (the 4 form)
    wins over ``rope_parameters`` (the 5 form); a ``rope_theta`` inside either
    wins over the top-level one.
    """
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
    keys = _ROPE_KEYS[kind]
    if kind == "default":
        spec.pop("factor", None)  # some writers leave factor=1.0 beside rope_type 'default'
    unknown, missing = sorted(set(spec) - set(keys)), sorted(set(keys) - set(spec))
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


def write_rope(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """Both the transformers 4 (``rope_theta``, ``rope_scaling``) and the 5
    (``rope_parameters``) form of these rotary settings."""
    if scaling is None:
        legacy = None
    elif scaling.kind == "linear":
        legacy = {"rope_type": "linear", "factor": scaling.factor}
    else:
        legacy = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
        }
    parameters = {"rope_type": "default", **(legacy or {}), "rope_theta": theta}
    return {"rope_theta": theta, "rope_scaling": legacy, "rope_parameters": parameters}
