"""The causal-LM policy core: what every objective that trains a causal language
model shares (LM, DPO, GRPO, PPO; distillation's student).

:class:`CausalPolicy` holds the policy module, its tokenizer and its starting
weights, and does, once for all of them:

- initialisation from a fresh init or ``init_params`` (a ``Pretrained`` load,
  an SFT run; :func:`dew.objectives.with_initial_values`), and the frozen
  reference: the initial policy itself (the same arrays, which the trainer
  stores once and, under LoRA, makes the base view), or ``reference=`` weights
  of ``reference_model`` (checked against its shapes);
- the token checks: integer ids inside the model's vocabulary
  (:func:`dew.objectives.contract.batch.check_token_ids`), and every length against the
  model's ``max_seq_len`` in one wording (:meth:`CausalPolicy.check_positions`);
- the tokenizer: ``ByteTokenizer()`` by default; a tokenizer given must fit the
  model's vocabulary, and two models scored on the same ids (policy and
  reference, student and teacher) must share one (:func:`check_same_vocabulary`):
  an error before anything is compiled, naming both sizes, or, when both
  tokenizers are known, both tokenizers whose id -> token tables differ
  (:func:`vocabulary_fingerprint`);
- previews (greedy continuation of a prompt) and export to
  :class:`dew.sampling.TextGeneration`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Any

import jax
import jax.numpy as jnp

from dew.nn.token_scores import check_chunk_size
from dew.objectives.contract.batch import check_token_ids
from dew.objectives.contract.objective import with_initial_values


def vocab_size_of(module) -> int | None:
    """A module's vocabulary (``vocab_size``), None when it does not say."""
    return getattr(module, "vocab_size", None)


VOCABULARY_PROBE = (
    "The quick brown fox: 0123 456.789, \u00dcn\u00efc\u00f6d\u00e9 \u4f60\u597d\n\tdef f(x):"
)
"""The text whose ids :func:`vocabulary_fingerprint` hashes beside the id table."""


def vocabulary_fingerprint(tokenizer) -> str:
    """A sha256 of what the tokenizer's ids mean: each id of ``range(vocab_size)``
    decoded alone (the id -> token table), the ids of :data:`VOCABULARY_PROBE` and the
    end and pad ids. Equal for two tokenizers that give ids the same text, whatever
    file they were read from; different tokenizers of one size differ in it."""
    digest = hashlib.sha256()
    for i in range(int(tokenizer.vocab_size)):
        digest.update(tokenizer.decode([i]).encode("utf-8", "surrogatepass") + b"\0")
    specials = [getattr(tokenizer, name, None) for name in ("end_id", "pad_id")]
    digest.update(json.dumps([tokenizer.encode(VOCABULARY_PROBE), specials]).encode())
    return digest.hexdigest()


def _same_tokenizer(a, b) -> bool:
    if a is b:
        return True
    fingerprints = [getattr(t, "fingerprint", None) for t in (a, b)]
    if all(callable(f) for f in fingerprints) and fingerprints[0]() == fingerprints[1]():
        return True  # the same file and options (cheap); else compare what the ids mean
    return vocabulary_fingerprint(a) == vocabulary_fingerprint(b)


def _describe(tokenizer) -> str:
    path = getattr(tokenizer, "path", None)
    return f"{type(tokenizer).__name__}({path})" if path else type(tokenizer).__name__


def check_same_vocabulary(
    first,
    second,
    *,
    what: str,
    names=("policy", "reference"),
    tokenizers=(None, None),
    fix: str | None = None,
) -> None:
    """Two models scored on the same token ids (policy and reference, student and
    teacher) must have one vocabulary: a ValueError naming both sizes. When both
    ``tokenizers`` are known (not None), same-size vocabularies must also mean the same
    tokens (:func:`vocabulary_fingerprint`): a ValueError naming both tokenizers.
    ``fix``: what to do, in the error; None = use one tokenizer."""
    a, b = vocab_size_of(first), vocab_size_of(second)
    fix = fix or (
        f"use a {names[1]} with the {names[0]}'s vocabulary (a cross-tokenizer setup needs "
        f"another loss)"
    )
    if a != b:
        raise ValueError(
            f"{what}: the {names[1]}'s vocabulary ({b} ids) differs from the {names[0]}'s "
            f"({a}); log-probs of the same ids are only comparable under one tokenizer, so "
            f"{fix}"
        )
    ta, tb = tokenizers
    if ta is None or tb is None or _same_tokenizer(ta, tb):
        return
    raise ValueError(
        f"{what}: the {names[1]}'s tokenizer {_describe(tb)} and the {names[0]}'s "
        f"{_describe(ta)} are different vocabularies of the same size ({a} ids in the "
        f"models; their id -> token tables differ: fingerprints "
        f"{vocabulary_fingerprint(tb)[:12]} vs {vocabulary_fingerprint(ta)[:12]}); {fix}"
    )


def resolve_tokenizer(tokenizer, model, *, what: str):
    """``tokenizer``, or ``ByteTokenizer()`` when None. A given tokenizer whose ids do not
    fit the model's vocabulary (``tokenizer.vocab_size > model.vocab_size``) is a
    ValueError: its ids would index past the embedding. The default is not checked:
    objectives over a toy vocabulary take ids from their data and decode them with it."""
    if tokenizer is None:
        from dew.data import ByteTokenizer

        return ByteTokenizer()
    vocab, ids = vocab_size_of(model), getattr(tokenizer, "vocab_size", None)
    if vocab is not None and ids is not None and ids > vocab:
        raise ValueError(
            f"{what}: the tokenizer has {ids} ids but the model's vocabulary only {vocab} "
            f"(vocab_size); ids >= {vocab} would index past the embedding. Use the model's own "
            f"tokenizer, or build the model with vocab_size >= {ids}"
        )
    return tokenizer


def check_chunked_model(model, chunk_size, *, what: str) -> None:
    """``logits_chunk_size`` must be None or an int >= 1, and a chunk size needs a model
    that scores targets itself (``model(tokens, targets=, logits_chunk_size=)``, as
    :class:`dew.nn.CausalTransformer` does); a ValueError naming both otherwise."""
    check_chunk_size(chunk_size, what=what)
    if chunk_size is None:
        return
    try:
        parameters = inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):  # no signature to read: let the model say at trace time
        return
    if "logits_chunk_size" not in parameters and not any(
        p.kind is p.VAR_KEYWORD for p in parameters.values()
    ):
        raise ValueError(
            f"{what}: logits_chunk_size={chunk_size} needs a model that scores targets over "
            f"the vocabulary in chunks (model(tokens, targets=..., logits_chunk_size=...), as "
            f"dew.nn.CausalTransformer), but {type(model).__name__} takes no "
            f"logits_chunk_size; use logits_chunk_size=None (the whole logits at once)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CausalPolicy:
    """A causal LM being trained, with its tokenizer and starting weights. Build it with
    :func:`causal_policy` (or :func:`policy_of` an objective), which resolves the
    defaults; the instance holds what it was given and only validates it.

    model: a causal module, ``model.apply(variables, ids) -> [batch, length, vocab]``.
    what: the objective's name, in errors (``"GRPOObjective"``).
    tokenizer: the tokenizer (:func:`resolve_tokenizer` gives ``ByteTokenizer()`` for
      None).
    reference_model: the reference's module (``model`` itself for a reference that is
      a copy of the policy); same vocabulary required (:func:`check_same_vocabulary`).
    init_params: starting weights; None = a fresh initialisation.
    reference: the reference's weights; None = the initial policy.
    """

    model: Any
    what: str
    tokenizer: Any
    reference_model: Any
    init_params: Any = None
    reference: Any = None

    def __post_init__(self):
        for name in ("tokenizer", "reference_model"):
            if getattr(self, name) is None:
                raise TypeError(
                    f"{self.what}: CausalPolicy needs {name}= (None is not resolved here); "
                    f"build it with dew.objectives.cores.policy.causal_policy(...), which "
                    f"gives the defaults"
                )
        check_same_vocabulary(self.model, self.reference_model, what=self.what)

    @property
    def vocab_size(self) -> int | None:
        return vocab_size_of(self.model)

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.model, "max_seq_len", None)

    # ---------------------------------------------------------------- init
    def init_policy(self, key: jax.Array, length: int):
        """The policy's parameter tree (boxed), from ``init_params`` when given."""
        params = self.model.init(key, jnp.zeros((1, length), jnp.int32))["params"]
        if self.init_params is None:
            return params
        return with_initial_values(params, self.init_params, what=f"{self.what} init_params")

    def init_reference(self, key: jax.Array, length: int, policy):
        """The frozen reference's parameters: ``policy`` itself (the same arrays: the
        trainer stores them once) or ``reference`` on ``reference_model``'s tree."""
        if self.reference is None:
            return policy
        if self.reference_model is self.model:
            fresh = policy
        else:
            fresh = self.reference_model.init(key, jnp.zeros((1, length), jnp.int32))["params"]
        return with_initial_values(fresh, self.reference, what=f"{self.what} reference")

    # -------------------------------------------------------------- checks
    def check_positions(self, needed: int, *, where: str, fix: str) -> None:
        """``needed`` positions must fit the model's ``max_seq_len``; ``where`` says what
        needs them, ``fix`` what to do (both in the error)."""
        max_len = self.max_seq_len
        if needed < 1:
            raise ValueError(f"{self.what}: {where} need {needed} positions; give at least 1")
        if max_len is not None and needed > max_len:
            raise ValueError(
                f"{self.what}: {where} need {needed} positions, more than the model's "
                f"max_seq_len {max_len}; {fix}, or build the model with max_seq_len >= {needed}"
            )

    def check_rollout_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """Prompts of ``prompt_len`` tokens continued by ``max_new_tokens`` must fit."""
        self.check_positions(
            prompt_len + max_new_tokens,
            where=f"prompts of {prompt_len} tokens plus max_new_tokens={max_new_tokens}",
            fix=f"use prompts of at most {(self.max_seq_len or 0) - max_new_tokens} tokens "
            f"(Prompts(prompt_len=...)) or fewer new tokens",
        )

    def rollout_length(self, spec, max_new_tokens: int) -> int:
        """The positions a rollout of the data's prompts (``spec['prompt']``, when the
        spec has it) plus ``max_new_tokens`` needs, checked against ``max_seq_len``."""
        length = max_new_tokens
        if spec is not None and "prompt" in spec:
            prompt_len = int(tuple(spec["prompt"].shape)[0])
            self.check_rollout_length(prompt_len, max_new_tokens)
            length += prompt_len
        return length

    def check_ids(self, ids, *, key: str) -> None:
        """Integer ids inside the model's vocabulary (the error names ``key``)."""
        check_token_ids(ids, self.vocab_size, key=key, what=f"{self.what}'s model")

    # ------------------------------------------------------ preview, export
    def preview(
        self, params, key: jax.Array, *, prompt="The", new_tokens=16, tokenizer=None
    ) -> str:
        """A greedy continuation of ``prompt`` (at most ``new_tokens``), decoded.
        ``tokenizer``: the objective's current one (None = :attr:`tokenizer`)."""
        from dew.sampling import Sampling, generate

        tokenizer = tokenizer or self.tokenizer
        ids = tokenizer.encode(prompt) or [0]
        max_len = self.max_seq_len or len(ids) + new_tokens
        new = max(1, min(new_tokens, max_len - len(ids)))
        out = generate(self.model, params, [ids], new, key, sampling=Sampling(temperature=0))
        return tokenizer.decode(out.tokens[0])

    def export(self, params, *, tokenizer=None, **options):
        """A :class:`dew.sampling.TextGeneration` of the policy (``options``: sampling,
        max_new_tokens, end_ids; ``tokenizer`` as in :meth:`preview`)."""
        from dew.sampling import TextGeneration

        return TextGeneration(self.model, params, tokenizer or self.tokenizer, **options)


def causal_policy(
    *,
    model,
    what: str,
    tokenizer=None,
    init_params=None,
    reference=None,
    reference_model=None,
) -> CausalPolicy:
    """A :class:`CausalPolicy` with the defaults resolved: ``tokenizer`` None =
    ``ByteTokenizer()`` (a given one must fit the model's vocabulary,
    :func:`resolve_tokenizer`), ``reference_model`` None = ``model``."""
    return CausalPolicy(
        model=model,
        what=what,
        tokenizer=resolve_tokenizer(tokenizer, model, what=what),
        reference_model=model if reference_model is None else reference_model,
        init_params=init_params,
        reference=reference,
    )


def policy_of(objective) -> CausalPolicy:
    """The :class:`CausalPolicy` of an objective's own fields: its ``model``, ``tokenizer``
    and, where it has them, ``init_params``, ``reference`` and ``reference_model``
    (the policy + reference pair of LM, DPO, GRPO, PPO and distillation's student)."""
    given = {
        name: getattr(objective, name)
        for name in ("init_params", "reference", "reference_model")
        if hasattr(objective, name)
    }
    return causal_policy(
        model=objective.model,
        what=type(objective).__name__,
        tokenizer=objective.tokenizer,
        **given,
    )
