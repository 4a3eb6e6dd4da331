"""Autoregressive language modelling: next-token cross-entropy.

For a row of ``seq_len + 1`` ids ``x``, the model reads ``x[:-1]`` and is
scored on ``x[1:]``:

    loss = -sum_t w_t log p(x_{t+1} | x_{<=t}) / sum_t w_t

with ``w`` the optional loss mask (1 everywhere by default). Packed rows (several
sequences in one row, ``dew.data.SFTExamples(packing=True)``) give
``segment_ids`` and ``positions``: the model attends within a segment only and
restarts its positions there, and a target in another segment than the id that
predicts it, or in segment 0 (padding), never counts. The loss is a
:class:`~dew.objectives.Weighted` mean over target tokens, so accumulation and
data parallelism divide once by the global token count. A model that sows
auxiliary losses (a mixture of experts' per-row load balance) adds
``aux_loss_weight`` times their mean over rows, a second term weighted by rows;
a mixture of experts' router z-loss and dropped fraction are metrics
(``moe_z_loss``, ``moe_dropped_fraction``) weighted the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.objectives.contract import registry
from dew.objectives.contract.batch import IDS, MASK, BatchField
from dew.objectives.contract.objective import EMA, Objective, Step, with_initial_values
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.policy import CausalPolicy, check_chunked_model, policy_of

# A mixture of experts' sown diagnostics (dew.nn.moe.MoE) and their metric names.
MOE_METRICS = {"z_loss": "moe_z_loss", "dropped_fraction": "moe_dropped_fraction"}


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """NLL of ``targets [batch, length]`` under ``logits [batch, length, vocab]`` (float32)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def target_weights(batch, tokens, *, loss_mask_key=None, segment_ids_key=None) -> jax.Array:
    """``[rows, length]`` float32 weight of each target ``tokens[:, 1:]`` of rows of ids:
    the loss mask's (1 without one), 0 on a target in another packed sequence than the
    id that predicts it or on padding (segment 0), and on padded validation rows."""
    weights = jnp.ones(tokens[:, 1:].shape, jnp.float32)
    if loss_mask_key is not None:
        weights = weights * batch[loss_mask_key][:, 1:].astype(jnp.float32)
    if segment_ids_key is not None:  # no target across packed sequences
        segments = batch[segment_ids_key]
        same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        weights = weights * same.astype(jnp.float32)
    if "example_mask" in batch:  # padded rows of a last validation batch
        weights = weights * batch["example_mask"][:, None].astype(jnp.float32)
    return weights


def packed_inputs(batch, *, segment_ids_key=None, positions_key=None) -> dict[str, jax.Array]:
    """The model's ``segment_ids`` / ``positions`` keywords of packed rows (the first
    ``length`` of each ``[rows, length + 1]`` row, as the model reads the ids)."""
    packed = {}
    if segment_ids_key is not None:
        packed["segment_ids"] = batch[segment_ids_key][:, :-1]
    if positions_key is not None:
        packed["positions"] = batch[positions_key][:, :-1]
    return packed


def check_packed_positions(positions: np.ndarray, max_len: int | None, *, key: str, what: str):
    """Packed positions must index the model's position range ``[0, max_seq_len)``."""
    if positions.size and (positions.min() < 0 or (max_len and positions.max() >= max_len)):
        raise ValueError(
            f"{what}: batch[{key!r}] holds positions from {positions.min()} to "
            f"{positions.max()}, outside the model's [0, max_seq_len = {max_len}); positions "
            f"count from 0 within each packed sequence"
        )


@registry.register("lm")
@dataclasses.dataclass(frozen=True, eq=False)
class LMObjective(Objective):
    """Next-token prediction for a causal model.

    model: a causal module, ``model.apply(variables, tokens) -> [batch, length, vocab]``.
    seq_len: positions the model reads per row; rows hold ``seq_len + 1`` ids.
      None = taken from the data's batch spec (``Dataset.spec``), stated once there.
    text_key: the batch key holding the token rows.
    loss_mask_key: optional batch key of a ``[batch, seq_len + 1]`` 0/1 mask; a
      target position counts when its mask is 1 (e.g. completion tokens only).
    segment_ids_key: optional batch key of ``[batch, seq_len + 1]`` int ids of the
      sequences packed in a row (0 = padding); handed to the model as
      ``segment_ids`` so no token attends across sequences.
    positions_key: optional batch key of ``[batch, seq_len + 1]`` int positions of
      each id within its own sequence; handed to the model as ``positions``.
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
    logits_chunk_size: score the targets this many positions of every row at a time
      (:func:`dew.nn.token_scores.chunked_scores`): the ``[batch, seq_len, vocab]``
      float32 logits are never held whole, in the forward or the backward pass,
      for one more output-head matmul per step (the backward pass recomputes
      each chunk). None (the default) = the whole logits at once: no recompute,
      and on the CPU the faster choice for small vocabularies (docs/performance.md).
      Needs a model that takes ``logits_chunk_size`` (:class:`dew.nn.CausalTransformer`).

    A mixture of experts also reports, next to ``aux_loss`` and weighted the
    same way (rows), the diagnostics in :data:`MOE_METRICS`: ``moe_z_loss``,
    the mean over rows and MoE layers of the router z-loss ``mean_t
    logsumexp(logits_t)^2`` (trained on or not), and, with a capacity factor,
    ``moe_dropped_fraction``, the mean over rows and MoE layers of the share of
    (token, choice) assignments dropped past an expert's capacity. Every row
    and layer routes the same ``length * k`` assignments, so that mean is the
    dropped share of all the step's assignments, exact over microbatches and
    devices (each microbatch, and each device of a routed dispatch on a mesh,
    drops against its own capacity).
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    seq_len: int | None = None
    text_key: str = "text"
    loss_mask_key: str | None = None
    segment_ids_key: str | None = None
    positions_key: str | None = None
    ema: EMA | None = None
    tokenizer: Any = None
    preview_prompt: str = "The"
    preview_tokens: int = 32
    init_params: Any = None
    aux_loss_weight: float = 0.01
    logits_chunk_size: int | None = None

    # printed on the log line when the model reports them (a mixture of experts)
    headline_metrics = ("aux_loss", "moe_dropped_fraction")

    def __post_init__(self):
        self.policy  # noqa: B018  (checks the tokenizer against the model now)
        check_chunked_model(self.model, self.logits_chunk_size, what="LMObjective")
        if self.seq_len is not None:
            self._check_seq_len(self.seq_len, "seq_len")

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: the model with its tokenizer (``tokenizer`` or a
        ``ByteTokenizer()``)."""
        return policy_of(self)

    def _check_seq_len(self, seq_len: int, where: str) -> None:
        self.policy.check_positions(
            seq_len, where=f"rows read at {where}={seq_len}", fix="use shorter rows"
        )

    def batch_fields(self):
        if self.seq_len is None:
            length, note = "length", ""
        else:
            length, note = self.seq_len + 1, f"rows of seq_len + 1 = {self.seq_len + 1} ids"
        fields = [BatchField(self.text_key, (length,), IDS, note=note)]
        if self.loss_mask_key is not None:  # one weight per id
            fields.append(BatchField(self.loss_mask_key, (length,), MASK, note=note))
        for key in (self.segment_ids_key, self.positions_key):
            if key is not None:
                fields.append(BatchField(key, (length,), IDS, note=note))
        return tuple(fields)

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
            return {"params": {"policy": variables["params"]}}
        # Keep the logical-axis boxes of a fresh init around the given values (and,
        # under LoRA, the fresh adapters the base weights lack).
        params = with_initial_values(
            variables["params"], self.init_params, what="LMObjective init_params"
        )
        return {"params": {"policy": params}}

    def _weights(self, batch, tokens):
        return target_weights(
            batch, tokens, loss_mask_key=self.loss_mask_key, segment_ids_key=self.segment_ids_key
        )

    def _forward(self, variables, batch):
        tokens = batch[self.text_key]
        packed = packed_inputs(
            batch, segment_ids_key=self.segment_ids_key, positions_key=self.positions_key
        )
        targets = tokens[:, 1:]
        weights = self._weights(batch, tokens)
        if self.logits_chunk_size is not None:  # the model scores the targets, in chunks
            scores, sown = self.model.apply(
                {"params": variables["params"]["policy"]},
                tokens[:, :-1],
                targets=targets,
                logits_chunk_size=self.logits_chunk_size,
                mutable=["intermediates"],
                **packed,
            )
            return scores.is_argmax, sown, weights, -scores.log_probs
        logits, sown = self.model.apply(
            {"params": variables["params"]["policy"]},
            tokens[:, :-1],
            mutable=["intermediates"],
            **packed,
        )
        nll = token_nll(logits, targets)  # [batch, seq_len]
        return jnp.argmax(logits, axis=-1) == targets, sown, weights, nll

    def loss(self, variables, batch, step: Step):
        from dew.nn.moe import collect_sown

        _, sown, weights, nll = self._forward(variables, batch)
        nll_mean = Weighted(total=jnp.sum(nll * weights), weight=jnp.sum(weights))
        metrics = {"nll": nll_mean, "tokens": Summed(jnp.sum(weights))}
        # What the model sowed decides, at trace time, which terms and metrics exist:
        # a model without experts sows none and traces the program it always has.
        aux = collect_sown(sown, "aux_loss", nll.shape[0])  # [batch] or None
        if aux is None:
            return nll_mean, metrics
        rows = batch["example_mask"] if "example_mask" in batch else None
        metrics["aux_loss"] = Weighted.mean(aux, rows)
        for sown_name, metric in MOE_METRICS.items():
            values = collect_sown(sown, sown_name, nll.shape[0])  # [batch] or None
            if values is not None:
                metrics[metric] = Weighted.mean(values, rows)
        return (nll_mean, metrics["aux_loss"].scale(self.aux_loss_weight)), metrics

    def evaluate(self, variables, batch, step: Step):
        is_argmax, _, weights, nll = self._forward(variables, batch)
        correct = is_argmax.astype(jnp.float32)
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
        return self.policy.preview(
            variables["params"]["policy"],
            key,
            prompt=self.preview_prompt,
            new_tokens=self.preview_tokens,
        )

    def export(self, variables):
        return self.policy.export(variables["params"]["policy"])

    def check_batch(self, batch):
        super().check_batch(batch)  # the declared fields: the key, [rows, seq_len + 1], dtypes
        tokens = np.asarray(batch[self.text_key])
        if self.seq_len is None:
            self._check_seq_len(tokens.shape[1] - 1, f"batch[{self.text_key!r}] row length - 1")
        self.policy.check_ids(tokens, key=self.text_key)
        if self.positions_key is not None:
            self._check_positions_of(np.asarray(batch[self.positions_key]))
        if self.loss_mask_key is None:
            return
        mask = np.asarray(batch[self.loss_mask_key])
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

    def _check_positions_of(self, positions: np.ndarray) -> None:
        check_packed_positions(
            positions, self.policy.max_seq_len, key=self.positions_key, what="LMObjective"
        )
