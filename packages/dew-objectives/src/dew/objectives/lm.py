"""Autoregressive language modelling: next-token cross-entropy.

For a row of ``seq_len + 1`` ids ``x``, the model reads ``x[:-1]`` and is
scored on ``x[1:]``:

    loss = -sum_t w_t log p(x_{t+1} | x_{<=t}) / sum_t w_t

with ``w`` the optional loss mask (1 everywhere by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.objectives.base import EMA, Objective, Step


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """NLL of ``targets [batch, length]`` under ``logits [batch, length, vocab]`` (float32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


@dataclasses.dataclass(eq=False)
class LMObjective(Objective):
    """Next-token prediction for a causal model.

    model: a causal module, ``model.apply(variables, tokens) -> [batch, length, vocab]``.
    seq_len: positions the model reads per row; rows hold ``seq_len + 1`` ids.
    text_key: the batch key holding the token rows.
    loss_mask_key: optional batch key of a ``[batch, seq_len + 1]`` 0/1 mask; a
      target position counts when its mask is 1 (e.g. completion tokens only).
    ema: moving-average spec, or None.
    tokenizer: turns previews and pipeline text into ids; None = ``ByteTokenizer()``.
    preview_prompt: the text a preview continues (greedy).
    preview_tokens: new tokens in a preview.
    init_params: start from these parameters (fine-tuning a ``Pretrained``)
      instead of a random initialisation.
    aux_loss_weight: weight of the auxiliary losses the model sows as
      ``intermediates/.../aux_loss`` (a mixture of experts' load balance):
      ``loss = nll / tokens + aux_loss_weight * mean(aux_loss)``; the mean is
      reported as the ``aux_loss`` metric. Models that sow none add nothing.
    """

    model: Any
    seq_len: int
    text_key: str = "text"
    loss_mask_key: str | None = None
    ema: EMA | None = None
    tokenizer: Any = None
    preview_prompt: str = "The"
    preview_tokens: int = 32
    init_params: Any = None
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 positions, got {self.seq_len}")
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and self.seq_len > max_len:
            raise ValueError(
                f"seq_len {self.seq_len} is longer than the model's max_seq_len {max_len}"
            )
        if self.tokenizer is None:
            from dew.data import ByteTokenizer

            self.tokenizer = ByteTokenizer()

    def init(self, key):
        variables = self.model.init(key, jnp.zeros((1, self.seq_len), jnp.int32))
        if self.init_params is None:
            return variables
        # Keep the logical-axis boxes of a fresh init around the given values.
        return {
            "params": jax.tree.map(
                lambda box, value: (
                    box.replace_boxed(jnp.asarray(value, box.unbox().dtype))
                    if isinstance(box, nn.meta.AxisMetadata)
                    else jnp.asarray(value, box.dtype)
                ),
                variables["params"],
                self.init_params,
                is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
            )
        }

    def _weights(self, batch, tokens):
        weights = jnp.ones(tokens[:, 1:].shape, jnp.float32)
        if self.loss_mask_key is not None:
            weights = weights * batch[self.loss_mask_key][:, 1:].astype(jnp.float32)
        if "example_mask" in batch:  # padded rows of a last validation batch
            weights = weights * batch["example_mask"][:, None].astype(jnp.float32)
        return weights

    def _sums(self, variables, batch, *, aux: list | None = None, accuracy: bool = False):
        tokens = batch[self.text_key]
        logits, sown = self.model.apply(
            {"params": variables["params"]}, tokens[:, :-1], mutable=["intermediates"]
        )
        if aux is not None:
            aux.extend(
                jnp.mean(v)
                for path, v in jax.tree_util.tree_leaves_with_path(sown)
                if any(getattr(k, "key", None) == "aux_loss" for k in path)
            )
        targets = tokens[:, 1:]
        weights = self._weights(batch, tokens)
        nll = token_nll(logits, targets)  # [batch, seq_len]
        sums = {"nll_sum": jnp.sum(nll * weights), "tokens": jnp.sum(weights)}
        if accuracy:  # evaluation only: an argmax over the vocab the step does not need
            correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
            sums["correct"] = jnp.sum(correct * weights)
        return sums

    def loss(self, variables, batch, step: Step):
        aux: list = []
        sums = self._sums(variables, batch, aux=aux)
        loss = sums["nll_sum"] / jnp.maximum(sums["tokens"], 1.0)
        if aux:
            sums["aux_loss"] = sum(aux) / len(aux)
            loss = loss + self.aux_loss_weight * sums["aux_loss"]
        return loss, sums

    def evaluate(self, variables, batch, step: Step):
        return self._sums(variables, batch, accuracy=True)

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        tokens = max(float(totals["tokens"]), 1.0)
        loss = float(totals["nll_sum"]) / tokens
        return {
            "loss": loss,
            "perplexity": float(np.exp(min(loss, 80.0))),
            "accuracy": float(totals["correct"]) / tokens,
            "tokens": float(totals["tokens"]),
        }

    def preview(self, variables, key):
        from dew.sampling import Sampling, generate

        prompt = self.tokenizer.encode(self.preview_prompt)
        max_len = getattr(self.model, "max_seq_len", len(prompt) + self.preview_tokens)
        new = max(1, min(self.preview_tokens, max_len - len(prompt)))
        out = generate(
            self.model, variables["params"], [prompt], new, key, sampling=Sampling(temperature=0)
        )
        return self.tokenizer.decode(out.tokens[0])

    def pipeline(self, state):
        from dew.sampling import TextGeneration

        params = (
            state.averaged if (self.ema is not None and self.evaluate_averaged) else state.params
        )
        return TextGeneration(self.model, params, self.tokenizer)

    def check_batch(self, batch):
        if self.text_key not in batch:
            raise KeyError(
                f"LMObjective needs batch[{self.text_key!r}]; the batch has keys {sorted(batch)}"
            )
        tokens = np.asarray(batch[self.text_key])
        if tokens.ndim != 2 or tokens.shape[1] != self.seq_len + 1:
            raise ValueError(
                f"batch[{self.text_key!r}] has shape {tokens.shape}; LMObjective(seq_len="
                f"{self.seq_len}) needs rows of seq_len + 1 = {self.seq_len + 1} ids "
                f"([rows, {self.seq_len + 1}])"
            )
        if not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"batch[{self.text_key!r}] must hold integer ids, got {tokens.dtype}")
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and tokens.size:
            largest, smallest = int(tokens.max()), int(tokens.min())
            if largest >= vocab or smallest < 0:
                bad = largest if largest >= vocab else smallest
                raise ValueError(
                    f"batch[{self.text_key!r}] holds token id {bad} outside the model's "
                    f"vocabulary (vocab_size {vocab}, largest id {largest}); check the "
                    f"tokenizer matches the model"
                )
