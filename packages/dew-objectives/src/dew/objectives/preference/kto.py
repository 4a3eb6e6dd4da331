"""Kahneman-Tversky Optimization (KTO; Ethayarajh et al. 2024, arXiv
2402.01306, eq. 7-8; TRL's ``KTOTrainer``) of a causal policy against a
frozen reference, on unpaired rows: each a prompt with one completion labelled
desirable or undesirable (no pairing needed).

With ``r = log pi(y|x) - log ref(y|x)`` (summed over the completion's tokens)
and the reference point ``z0`` (below), the loss per row is

    desirable:    lambda_D (1 - sigmoid(beta (r - z0)))
    undesirable:  lambda_U (1 - sigmoid(beta (z0 - r)))

a :class:`Weighted` mean over the rows (TRL's mean of the concatenated
weighted losses). ``z0 = max(0, mean_i (log pi(y_{i+1}|x_i) - log ref(y_{i+1}|x_i)))``
estimates ``KL(pi || ref)`` on mismatched pairs, each row's prompt with the
next row's completion in the (micro)batch, as TRL pairs them; it carries no
gradient. The maths are :mod:`dew.objectives.preference.losses`'. ``z0`` is
a mean over the whole batch (on any number of devices), so the trainer's
``accumulate`` stays 1 (:meth:`KTOObjective.accumulate_for`).

Batches (the layout of :class:`dew.data.PreferencePairs`' sequences, ``[rows,
length]``: prompt, then completion, then right padding): ``completion`` (ids),
``completion_mask`` (True on the completion), ``prompt_mask`` (True on the
prompt, a prefix of the row) and ``label`` ``[rows]`` (True = desirable).
With ``pairs=True`` it reads :class:`dew.data.PreferencePairs`' batches instead
and unpairs them (TRL's ``unpair_preference_dataset``): each pair's chosen
completion a desirable row, its rejected one an undesirable row; the mismatched
pairs then take the completion of the next *pair*. Every batch needs both
labels (the paper: imbalance is handled with
``desirable_weight`` / ``undesirable_weight``, TRL's recommended range
``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]).

Metrics: ``kl`` (``z0``), ``reward_desirable`` / ``reward_undesirable`` (the
means of ``beta r``), ``margin`` (their difference), ``accuracy`` (the share of
rows on the side of ``z0`` their label asks for).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import IDS, MASK, BatchField, first_row
from dew.objectives.contract.objective import Objective, Role, Step
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import masked_sum, sequence_logprobs
from dew.objectives.cores.policy import CausalPolicy, check_chunked_model, policy_of
from dew.objectives.preference.losses import kto_losses, kto_reference_point

KEYS = ("completion", "completion_mask", "prompt_mask", "label")
PAIR_KEYS = ("chosen", "chosen_mask", "rejected", "rejected_mask", "prompt_mask")


def unpaired(batch):
    """Rows ``[c0, r0, c1, r1, ...]`` (KEYS, and ``example_mask`` when given) from a
    batch of preference pairs: chosen desirable, rejected undesirable."""
    pairs = batch["chosen"].shape[0]

    def mix(a, b):
        return jnp.stack([a, b], axis=1).reshape(2 * pairs, *a.shape[1:])

    out = {
        KEYS[0]: mix(batch["chosen"], batch["rejected"]),
        KEYS[1]: mix(batch["chosen_mask"], batch["rejected_mask"]),
        KEYS[2]: mix(batch["prompt_mask"], batch["prompt_mask"]),
        KEYS[3]: mix(jnp.ones(pairs, bool), jnp.zeros(pairs, bool)),
    }
    if "example_mask" in batch:
        out["example_mask"] = mix(batch["example_mask"], batch["example_mask"])
    return out


def mismatched(
    ids: jax.Array, prompt_mask: jax.Array, completion_mask: jax.Array, *, shift: int = 1
):
    """Each row's prompt followed by the completion of the row ``shift`` rows on
    (cyclically; cut to the row's length), then the row's own ids as padding:
    ``(ids, completion_mask)``, each ``[rows, length]``. Prompts are prefixes of
    their rows."""
    rows, length = ids.shape
    prompt_len = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)  # [rows]
    other = jnp.roll(ids, -shift, axis=0)
    other_start = jnp.roll(prompt_len, -shift)  # its completion starts after its prompt
    other_len = jnp.roll(jnp.sum(completion_mask, axis=1).astype(jnp.int32), -shift)
    t = jnp.arange(length)[None, :]
    offset = t - prompt_len[:, None]  # position within the borrowed completion
    in_completion = (offset >= 0) & (offset < other_len[:, None])
    source = jnp.clip(other_start[:, None] + offset, 0, length - 1)
    borrowed = jnp.take_along_axis(other, source, axis=1)
    new_ids = jnp.where(t < prompt_len[:, None], ids, jnp.where(in_completion, borrowed, ids))
    return new_ids, in_completion


@registry.register("kto")
@dataclasses.dataclass(frozen=True, eq=False)
class KTOObjective(Objective):
    """KTO on a causal policy (module docstring for the maths).

    model: the policy (:class:`dew.nn.CausalTransformer`).
    reference: the reference's parameters; None = a copy of the initial policy
      (``init_params`` when given). The frozen role ``"reference"``.
    beta: the implicit reward's inverse temperature (TRL's default 0.1).
    desirable_weight, undesirable_weight: ``lambda_D``, ``lambda_U`` (1.0 each).
    init_params: start the policy from these parameters.
    tokenizer: previews and the exported pipeline; None = ``ByteTokenizer()``.
    logits_chunk_size: as :class:`~dew.objectives.DPOObjective`'s.
    pairs: read preference pairs and unpair them (module docstring).
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    reference: Any = None
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    init_params: Any = None
    tokenizer: Any = None
    logits_chunk_size: int | None = None
    pairs: bool = False

    headline_metrics = ("accuracy", "kl")

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"KTOObjective needs beta > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"KTOObjective needs {name} > 0, got {getattr(self, name)}")
        self.policy  # noqa: B018  (checks the tokenizer and vocabulary now)
        check_chunked_model(self.model, self.logits_chunk_size, what="KTOObjective")

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: policy, tokenizer, initial weights and reference."""
        return policy_of(self)

    def accumulate_for(self, data_parallel: int) -> int | None:
        """1: the reference point ``z0`` is a mean over the whole batch, and each
        microbatch of an accumulated step would have its own (another loss); the
        trainer refuses ``accumulate`` > 1. Devices share one batch (``z0`` global)."""
        return 1

    def roles(self) -> tuple[Role, ...]:
        initial = "policy" if self.reference is None else None
        return (
            Role(name="policy", module=self.model),
            Role(name="reference", module=self.model, trained=False, initial_from=initial),
        )

    def batch_fields(self):
        if self.pairs:
            return tuple(
                BatchField(k, ("length",), IDS if k in ("chosen", "rejected") else MASK)
                for k in PAIR_KEYS
            )
        completion, completion_mask, prompt_mask, label = KEYS
        return (
            BatchField(completion, ("length",), IDS),
            BatchField(completion_mask, ("length",), MASK),
            BatchField(prompt_mask, ("length",), MASK),
            BatchField(label, (), MASK),
        )

    def init(self, key, spec=None):
        ids = PAIR_KEYS[0] if self.pairs else KEYS[0]
        if spec is not None and ids in spec:
            length = int(tuple(spec[ids].shape)[0])
        else:
            length = int(getattr(self.model, "max_seq_len", 8))
        params = self.policy.init_policy(key, length)
        return {
            "params": {"policy": params},
            "reference": {"params": self.policy.init_reference(key, length, params)},
        }

    # ------------------------------------------------------------------ loss
    def _scores(self, params, model_ids, mask):
        tokens = sequence_logprobs(
            self.model, params, model_ids, logits_chunk_size=self.logits_chunk_size
        )
        return masked_sum(tokens, mask)

    def _terms(self, variables, batch):
        if self.pairs:
            batch = unpaired(batch)
        ids, mask, prompt_mask = batch[KEYS[0]], batch[KEYS[1]], batch[KEYS[2]]
        desirable = batch[KEYS[3]].astype(bool)
        rows = (
            batch["example_mask"].astype(jnp.float32)
            if "example_mask" in batch
            else jnp.ones(desirable.shape, jnp.float32)
        )
        shift = 2 if self.pairs else 1  # the next pair's completion, not the partner's
        other_ids, other_mask = mismatched(ids, prompt_mask, mask, shift=shift)
        # one forward pass per model scores the rows and the mismatched pairs
        both = jnp.concatenate([ids, other_ids])
        both_mask = jnp.concatenate([mask, other_mask])
        policy = self._scores(variables["params"]["policy"], both, both_mask)
        reference = jax.lax.stop_gradient(
            self._scores(variables["reference"]["params"], both, both_mask)
        )
        n = ids.shape[0]
        z0 = kto_reference_point(
            policy[n:], reference[n:], rows=rows * jnp.roll(rows, -shift)
        )  # both rows of a mismatched pair real
        logratios = policy[:n] - reference[:n]
        losses = kto_losses(
            logratios,
            desirable,
            z0,
            beta=self.beta,
            desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        loss = Weighted.mean(losses, rows)
        rewards = jax.lax.stop_gradient(self.beta * logratios)
        good, bad = rows * desirable, rows * ~desirable
        reward_good, reward_bad = Weighted.mean(rewards, good), Weighted.mean(rewards, bad)
        right_side = jnp.where(desirable, logratios > z0, logratios < z0)
        metrics = {
            "kto_loss": loss,
            "kl": Weighted.mean(jnp.broadcast_to(z0, rows.shape), rows),
            "reward_desirable": reward_good,
            "reward_undesirable": reward_bad,
            "accuracy": Weighted.mean(right_side.astype(jnp.float32), rows),
            "rows": Summed(jnp.sum(rows)),
        }
        return loss, metrics

    def loss(self, variables, batch, step: Step):
        return self._terms(variables, batch)

    def evaluate(self, variables, batch, step: Step):
        loss, metrics = self._terms(variables, batch)
        return {"loss": loss, **{k: v for k, v in metrics.items() if k != "kto_loss"}}

    def preview(self, variables, key):
        return self.policy.preview(
            variables["params"]["policy"], key, tokenizer=self.policy.tokenizer
        )

    def export(self, variables):
        return self.policy.export(variables["params"]["policy"], tokenizer=self.policy.tokenizer)

    # ------------------------------------------------------------ bad input
    def check_batch(self, batch):
        super().check_batch(batch)
        if self.pairs:
            batch = jax.tree.map(np.asarray, unpaired(batch))
        ids = np.asarray(batch[KEYS[0]])
        mask = np.asarray(batch[KEYS[1]]).astype(bool)
        prompt = np.asarray(batch[KEYS[2]]).astype(bool)
        label = np.asarray(batch[KEYS[3]])
        rows = np.asarray(batch.get("example_mask", np.ones(len(ids), bool))).astype(bool)
        self.policy.check_positions(
            ids.shape[1],
            where=f"rows of batch[{KEYS[0]!r}] ({ids.shape[1]} ids)",
            fix="shorten them",
        )
        self.policy.check_ids(ids, key=KEYS[0])
        if not np.isin(label, (0, 1)).all():
            raise ValueError(
                f"KTOObjective: batch['label'] must be True (desirable) or False (undesirable) "
                f"for every row, got values {sorted(set(np.unique(label).tolist()))[:8]}"
            )
        label = label.astype(bool)
        if rows.any() and (label[rows].all() or not label[rows].any()):
            kind = "desirable" if label[rows].all() else "undesirable"
            raise ValueError(
                f"KTOObjective: every row of this batch is {kind}; KTO needs both labels in each "
                f"batch (its loss compares rows with the reference point from the whole batch). "
                f"Shuffle the rows, or raise the batch size"
            )
        starts_prompt = prompt[:, 0] | ~prompt.any(axis=1)
        prefix = (np.cumsum(~prompt, axis=1) == 0) == prompt
        if found := first_row(rows & ~(starts_prompt & prefix.all(axis=1) & prompt.any(axis=1))):
            raise ValueError(
                f"KTOObjective: row {found[0]}'s prompt_mask is not a non-empty prefix of the row "
                f"({found[1]} such rows); rows are a prompt, then the completion, then padding"
            )
        if found := first_row(rows & ~mask.any(axis=1)):
            raise ValueError(
                f"KTOObjective: row {found[0]} has an empty completion ({found[1]} such rows); "
                f"drop them in the data"
            )
