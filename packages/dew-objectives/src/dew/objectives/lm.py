"""Autoregressive language modelling: next-token cross-entropy.

For a row of ``seq_len + 1`` ids ``x``, the model reads ``x[:-1]`` and is
scored on ``x[1:]``:

    loss = -sum_t w_t log p(x_{t+1} | x_{<=t}) / sum_t w_t

with ``w`` the optional loss mask (1 everywhere by default). The loss is a
:class:`~dew.objectives.Weighted` mean over target tokens, so accumulation and
data parallelism divide once by the global token count. A model that sows
auxiliary losses (a mixture of experts' per-row load balance) adds
``aux_loss_weight`` times their mean over rows, a second term weighted by rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.objectives.base import EMA, Objective, Step, with_initial_values
from dew.objectives.weighted import Summed, Weighted


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """NLL of ``targets [batch, length]`` under ``logits [batch, length, vocab]`` (float32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


@dataclasses.dataclass(eq=False)
class LMObjective(Objective):
    """Next-token prediction for a causal model.

    model: a causal module, ``model.apply(variables, tokens) -> [batch, length, vocab]``.
    seq_len: positions the model reads per row; rows hold ``seq_len + 1`` ids.
      None = taken from the data's batch spec (``Dataset.spec``), stated once there.
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
      ``intermediates/.../aux_loss`` (a mixture of experts' per-row load
      balance): ``loss = nll_sum / tokens + aux_loss_weight * mean_rows(aux_loss)``;
      the mean is reported as the ``aux_loss`` metric. Models that sow none
      add nothing.
    """

    model: Any
    seq_len: int | None = None
    text_key: str = "text"
    loss_mask_key: str | None = None
    ema: EMA | None = None
    tokenizer: Any = None
    preview_prompt: str = "The"
    preview_tokens: int = 32
    init_params: Any = None
    aux_loss_weight: float = 0.01

    def __post_init__(self):
        if self.seq_len is not None:
            self._check_seq_len(self.seq_len, "seq_len")
        if self.tokenizer is None:
            from dew.data import ByteTokenizer

            self.tokenizer = ByteTokenizer()

    def _check_seq_len(self, seq_len: int, where: str) -> None:
        if seq_len < 1:
            raise ValueError(f"{where} must be >= 1 positions, got {seq_len}")
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and seq_len > max_len:
            raise ValueError(
                f"{where} {seq_len} is longer than the model's max_seq_len {max_len}; "
                f"build the model with max_seq_len >= {seq_len} or use shorter rows"
            )

    def positions(self, spec=None) -> int:
        """Positions the model reads per row: ``seq_len``, or the batch spec's row
        length minus one; both given and different is an error naming both."""
        row = None
        if spec is not None and self.text_key in spec:
            row = int(tuple(spec[self.text_key].shape)[0]) - 1
        if self.seq_len is not None:
            if row is not None and row != self.seq_len:
                raise ValueError(
                    f"LMObjective(seq_len={self.seq_len}) reads rows of {self.seq_len + 1} "
                    f"ids, but the data declares batch[{self.text_key!r}] rows of "
                    f"{row + 1} ids; drop seq_len (the data states it) or make them agree"
                )
            return self.seq_len
        if row is None:
            raise ValueError(
                f"LMObjective has no seq_len and the data declares no {self.text_key!r} "
                f"field (Dataset.spec); pass LMObjective(seq_len=...) or a Dataset with a spec"
            )
        self._check_seq_len(row, f"the data's {self.text_key!r} row length - 1")
        return row

    def init(self, key, spec=None):
        seq_len = self.positions(spec)
        variables = self.model.init(key, jnp.zeros((1, seq_len), jnp.int32))
        if self.init_params is None:
            return variables
        # Keep the logical-axis boxes of a fresh init around the given values (and,
        # under LoRA, the fresh adapters the base weights lack).
        params = with_initial_values(
            variables["params"], self.init_params, what="LMObjective init_params"
        )
        return {"params": params}

    def _weights(self, batch, tokens):
        weights = jnp.ones(tokens[:, 1:].shape, jnp.float32)
        if self.loss_mask_key is not None:
            weights = weights * batch[self.loss_mask_key][:, 1:].astype(jnp.float32)
        if "example_mask" in batch:  # padded rows of a last validation batch
            weights = weights * batch["example_mask"][:, None].astype(jnp.float32)
        return weights

    def _forward(self, variables, batch):
        tokens = batch[self.text_key]
        logits, sown = self.model.apply(
            {"params": variables["params"]}, tokens[:, :-1], mutable=["intermediates"]
        )
        targets = tokens[:, 1:]
        weights = self._weights(batch, tokens)
        nll = token_nll(logits, targets)  # [batch, seq_len]
        return logits, sown, targets, weights, nll

    def loss(self, variables, batch, step: Step):
        from dew.nn.moe import collect_aux_losses

        _, sown, _, weights, nll = self._forward(variables, batch)
        nll_mean = Weighted(total=jnp.sum(nll * weights), weight=jnp.sum(weights))
        metrics = {"nll": nll_mean, "tokens": Summed(jnp.sum(weights))}
        aux = collect_aux_losses(sown, nll.shape[0])  # [batch] or None
        if aux is None:
            return nll_mean, metrics
        rows = batch["example_mask"] if "example_mask" in batch else None
        metrics["aux_loss"] = Weighted.mean(aux, rows)
        return (nll_mean, metrics["aux_loss"].scale(self.aux_loss_weight)), metrics

    def evaluate(self, variables, batch, step: Step):
        logits, _, targets, weights, nll = self._forward(variables, batch)
        correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
        return {
            "loss": Weighted(total=jnp.sum(nll * weights), weight=jnp.sum(weights)),
            "accuracy": Weighted(total=jnp.sum(correct * weights), weight=jnp.sum(weights)),
            "tokens": Summed(jnp.sum(weights)),
        }

    def summarize(self, results: Mapping[str, float]) -> dict[str, float]:
        loss = results["loss"]
        return {
            "loss": loss,
            "perplexity": float(np.exp(min(loss, 80.0))),
            "accuracy": results["accuracy"],
            "tokens": results["tokens"],
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

    def export(self, variables):
        from dew.sampling import TextGeneration

        return TextGeneration(self.model, variables["params"], self.tokenizer)

    def check_batch(self, batch):
        if self.text_key not in batch:
            raise KeyError(
                f"LMObjective needs batch[{self.text_key!r}]; the batch has keys {sorted(batch)}"
            )
        tokens = np.asarray(batch[self.text_key])
        if tokens.ndim != 2 or (self.seq_len is not None and tokens.shape[1] != self.seq_len + 1):
            raise ValueError(
                f"batch[{self.text_key!r}] has shape {tokens.shape}; LMObjective(seq_len="
                f"{self.seq_len}) needs rows of seq_len + 1 = {self.seq_len + 1} ids "
                f"([rows, {self.seq_len + 1}])"
            )
        if self.seq_len is None:
            self._check_seq_len(tokens.shape[1] - 1, f"batch[{self.text_key!r}] row length - 1")
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
        if self.loss_mask_key is not None:
            self._check_mask(batch)

    def _check_mask(self, batch) -> None:
        if self.loss_mask_key not in batch:
            raise KeyError(
                f"LMObjective(loss_mask_key={self.loss_mask_key!r}) needs that key in the "
                f"batch; the batch has keys {sorted(batch)}"
            )
        mask = np.asarray(batch[self.loss_mask_key])
        tokens = np.asarray(batch[self.text_key])
        if mask.shape != tokens.shape:
            raise ValueError(
                f"batch[{self.loss_mask_key!r}] has shape {mask.shape}; it must match "
                f"batch[{self.text_key!r}] {tokens.shape} (one weight per id)"
            )
        if mask.size and mask.min() < 0:
            raise ValueError(
                f"LMObjective: batch[{self.loss_mask_key!r}] holds a negative weight "
                f"({mask.min()}); loss weights must be >= 0"
            )
        if mask.size and not mask[:, 1:].any():
            raise ValueError(
                f"LMObjective: every target of this batch is masked out "
                f"(batch[{self.loss_mask_key!r}][:, 1:] is all 0 over {mask.shape[0]} rows), "
                f"so its loss has weight 0; drop such batches in the reader or unmask a target"
            )
