"""The text-encoder route of :class:`~dew.objectives.diffusion.images.DiffusionObjective`.

A text-conditioned denoiser reads ``context [batch, tokens, features]``. Its text
encoder is the user's choice (``docs/diffusion.md``):

- **frozen**: a checkpoint (:meth:`dew.sampling.TextEncoder.load`, its ``params``
  required) whose contexts come precomputed in ``batch['context']``;
- **trained** (``train_text_encoder=True``): a second trained role ``text_encoder``
  (``variables['params'] = {'policy': ..., 'text_encoder': ...}``), started from its
  ``params`` or a fresh init; batches carry token ids ``batch[text_key] int32 [batch,
  max_length]`` and the loss encodes them, ``c = E_phi(ids)``
  (:func:`dew.sampling.diffusion.text_encoders.encode_tokens`), so the gradient of the diffusion
  loss reaches ``phi``.

Either way, sampling from prompts, previews and the exported ``TextToImage`` /
``TextToVideo`` pipeline encode with :meth:`TextConditioning.text_encoder_of` the
variables (the trained, averaged weights when the encoder is trained).

:class:`TextConditioning` is a component: a frozen dataclass the objective holds
(``DiffusionObjective.conditions.text``), built from the objective's options and the
model's ``context_features``; it checks them when it is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract.batch import IDS, MASK, BatchField
from dew.objectives.contract.objective import Role, with_initial_values
from dew.sampling.diffusion.pipelines import TextToImage, TextToVideo
from dew.sampling.diffusion.text_encoders import encode_tokens

CONTEXTS = ("floating", "bfloat16")  # text embeddings


def model_conditions(model) -> tuple[int, int]:
    """``(num_classes, context_features)`` of a denoiser: its class labels (label
    ``num_classes`` is the null class; 0 = none) and the width of the text contexts it
    reads (0 = none)."""
    return (
        int(getattr(model, "num_classes", 0) or 0),
        int(getattr(model, "context_features", 0) or 0),
    )


def guided_context_mask(context_mask, guidance: float):
    """The mask of the doubled batch under guidance: the null rows attend to everything."""
    mask = jnp.asarray(context_mask, bool)
    if guidance == 1.0:
        return mask
    return jnp.concatenate([mask, jnp.ones_like(mask)])


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class TextConditioning:
    """The text encoder of a diffusion objective: its checks, role, init, encoding in
    the loss, prompts and pipeline (module docstring).

    text_encoder: the :class:`dew.sampling.TextEncoder` (frozen: its ``params``
      required; trained: its ``params`` the start, None = a fresh init); None = none.
    train_text_encoder: train it with the denoiser (role ``text_encoder``).
    text_key: the batch key of the token ids of a trained encoder.
    null_context: ``[tokens, features]`` embedding of the null prompt; None = zeros.
    context_features: the width of the contexts the denoiser reads (0 = none).
    is_video: the pipeline is ``TextToVideo`` (else ``TextToImage``).
    """

    text_encoder: Any = None
    train_text_encoder: bool = False
    text_key: str = "text"
    null_context: Any = None
    context_features: int = 0
    is_video: bool = False

    def __post_init__(self):
        self.check_text_options()

    def check_text_options(self) -> None:
        """Raise on a text encoder that does not fit the model or the route."""
        if self.text_encoder is not None and self.text_encoder.features != self.context_features:
            raise ValueError(
                f"text_encoder gives {self.text_encoder.features} features a token, the model "
                f"reads context_features={self.context_features}; build the model with "
                f"context_features={self.text_encoder.features}"
            )
        if self.train_text_encoder and (self.text_encoder is None or not self.context_features):
            raise ValueError(
                f"train_text_encoder=True trains a text encoder for a text-conditioned model: "
                f"pass text_encoder=TextEncoder(module=..., params=None, tokenizer=...) and a "
                f"model with context_features (got text_encoder={self.text_encoder!r:.60}, "
                f"context_features={self.context_features})"
            )
        if (
            not self.train_text_encoder
            and self.text_encoder is not None
            and self.text_encoder.params is None
        ):
            raise ValueError(
                "a frozen text_encoder needs its params (TextEncoder.load(...)); to train one "
                "with the denoiser pass DiffusionObjective(train_text_encoder=True)"
            )

    # ------------------------------------------------------------------- roles
    def roles(self, model) -> tuple[Role, ...]:
        """``policy`` (the denoiser ``model``); with ``train_text_encoder`` also the
        trained ``text_encoder``."""
        if not self.train_text_encoder:
            return (Role(name="policy", module=model),)
        return (
            Role(name="policy", module=model),
            Role(name="text_encoder", module=self.text_encoder.module),
        )

    def denoiser_params(self, params):
        """The denoiser's tree of ``variables['params']``."""
        return params["policy"]

    def text_encoder_of(self, variables):
        """The :class:`~dew.sampling.TextEncoder` of these variables: the frozen one, or
        the trained module with ``variables['params']['text_encoder']``."""
        if not self.train_text_encoder or self.text_encoder is None:
            return self.text_encoder
        return dataclasses.replace(self.text_encoder, params=variables["params"]["text_encoder"])

    # ------------------------------------------------------------ init and loss
    def init_with_text_encoder(self, key: jax.Array, init_denoiser: Callable):
        """``{'params': {'policy': ..., 'text_encoder': ...}}`` of a trained encoder: the
        denoiser's ``init_denoiser(key, tokens)`` with ``max_length`` context tokens, the
        encoder from its ``params`` when given (else its fresh init)."""
        k_model, k_text = jax.random.split(key)
        tokens = self.text_encoder.max_length
        ids = jnp.zeros((1, tokens), jnp.int32)
        text = self.text_encoder.module.init(k_text, ids)["params"]
        if self.text_encoder.params is not None:
            text = with_initial_values(text, self.text_encoder.params, what="text_encoder.params")
        model = init_denoiser(k_model, tokens)
        return {"params": {"policy": model["params"], "text_encoder": text}}

    def with_encoded_text(self, params, batch):
        """``batch`` with ``context = E_phi(batch[text_key])`` ``[batch, tokens, features]``
        from the trained encoder's ``params['text_encoder']`` (in the graph)."""
        ids = jnp.asarray(batch[self.text_key], jnp.int32)
        context = encode_tokens(self.text_encoder.module, params["text_encoder"], ids)
        return {**batch, "context": context}

    # ------------------------------------------------------- sampling and export
    def prompts_context(self, variables, prompts, context) -> jax.Array:
        """The context of ``prompts`` (strings), encoded by :meth:`text_encoder_of` the
        variables; ``context=`` too is an error."""
        if self.text_encoder is None or context is not None:
            raise ValueError(
                "prompts= are encoded by the objective's text_encoder and replace context=: "
                "pass one of them, and DiffusionObjective(text_encoder=...) for prompts"
            )
        return self.text_encoder_of(variables)(list(prompts))

    def text_pipeline(self, variables, fields: dict):
        """The ``TextToVideo`` / ``TextToImage`` pipeline of ``fields`` with the encoder of
        these variables and the null context (zeros ``[max_length, features]`` by default)."""
        if self.text_encoder is None:
            raise ValueError(
                "a text-conditioned model exports a TextToImage / TextToVideo pipeline, "
                "which needs the text encoder that made batch['context']: pass "
                "DiffusionObjective(text_encoder=TextEncoder.load(...))"
            )
        null = self.null_context
        if null is None:
            null = np.zeros((self.text_encoder.max_length, self.context_features), np.float32)
        task = TextToVideo if self.is_video else TextToImage
        encoder = self.text_encoder_of(variables)
        return task(**fields, text_encoder=encoder, null_context=null)

    # ------------------------------------------------------------------ checks
    def text_fields(self) -> tuple[BatchField, ...]:
        """The text batch fields: token ids ``[max_length]`` for a trained encoder, else
        contexts ``[tokens, context_features]`` (and an optional ``context_mask``
        ``[tokens]``); none for a model without ``context_features``."""
        if not self.context_features:
            return ()
        if self.train_text_encoder:
            length = self.text_encoder.max_length
            note = f"max_length={length} token ids: text_encoder.tokenize(captions)"
            return (BatchField(self.text_key, (length,), IDS, note=note),)
        features = self.context_features
        note = f"text embeddings, context_features={features}"
        return (
            BatchField("context", ("tokens", features), CONTEXTS, note=note),
            BatchField("context_mask", ("tokens",), MASK, required=False),
        )

    def check_text_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """The values :meth:`text_fields` cannot state: token ids in the encoder's
        vocabulary, and a ``null_context`` of the contexts' shape."""
        if self.train_text_encoder:
            self._check_token_ids(batch)
            return
        context = np.asarray(batch["context"])
        if self.null_context is not None and np.shape(self.null_context) != context.shape[1:]:
            raise ValueError(
                f"null_context has shape {np.shape(self.null_context)}, the batch's context "
                f"rows {context.shape[1:]}: give the null prompt's embeddings at that shape"
            )

    def _check_token_ids(self, batch) -> None:
        """The token ids of a trained text encoder in the encoder's vocabulary."""
        length = self.text_encoder.max_length
        ids = np.asarray(batch[self.text_key])
        vocab = getattr(self.text_encoder.module, "vocab_size", None)
        if vocab and ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(
                f"batch[{self.text_key!r}] holds ids {ids.min()}..{ids.max()}, the text "
                f"encoder's vocabulary is 0..{vocab - 1}: use its tokenizer"
            )
        want = (length, self.context_features)
        if self.null_context is not None and np.shape(self.null_context) != want:
            raise ValueError(
                f"null_context has shape {np.shape(self.null_context)}; the trained text "
                f"encoder's contexts are {want} (max_length, features)"
            )
