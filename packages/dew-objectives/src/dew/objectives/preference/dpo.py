"""Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290) and its variants.

For a prompt ``x`` with a preferred completion ``y_w`` and a rejected one
``y_l``, with sequence log-probs summed over the completion's tokens only
(``pi_w = log pi_theta(y_w | x)``, ``ref_w = log pi_ref(y_w | x)``, the same for
``l``) and

    h = (pi_w - ref_w) - (pi_l - ref_l)

the loss per pair is

    sigmoid (DPO, eq. 7):     -log sigmoid(beta h)
    cdpo (Mitchell 2023, "A note on DPO with noisy preferences"; TRL's
      label_smoothing):       -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
    ipo (Azar et al. 2023, arXiv 2310.12036, eq. 17):   (h - 1 / (2 beta))^2

    simpo (Meng et al. 2024, arXiv 2405.14734, eq. 6):
                              -log sigmoid(beta avg_w - beta avg_l - simpo_gamma)
    orpo (Hong et al. 2024, arXiv 2403.07691, eq. 4-7):
                              NLL(y_w) - beta log sigmoid(log odds(y_w) - log odds(y_l))

with ``avg = pi / |y|`` the length-normalised log-prob and ``log odds(y) = avg -
log(1 - exp(avg))`` (:mod:`dew.objectives.preference.losses` holds each loss as
a pure function). SimPO and ORPO are reference-free: no reference role is
created, and a reference given is refused (it would be unused); their implicit
rewards are ``beta avg``. ORPO's NLL is the mean over the chosen completions'
tokens, a second term as RPO's.

``sigmoid`` and ``simpo`` take ``label_smoothing`` too (then it is cDPO's). With ``rpo_alpha``
(Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv
2404.19733) the loss adds ``rpo_alpha`` times the policy's mean per-token NLL
of the chosen completions, a second term weighted by chosen tokens.

The implicit rewards ``r_w = beta (pi_w - ref_w)``, ``r_l = beta (pi_l - ref_l)``
give the metrics: their means, the margin ``r_w - r_l`` and the accuracy
``1[r_w > r_l]`` (strict: 0 at initialisation, where policy = reference). The
loss is a :class:`Weighted` mean over pairs.

Batches are what :class:`dew.data.PreferencePairs` produces (all ``[pairs,
length]``, prompt then completion then right padding): ``chosen``,
``rejected`` (ids), ``chosen_mask``, ``rejected_mask`` (True on the completion's
ids) and ``prompt_mask``. Optional ``ref_chosen_logps``, ``ref_rejected_logps``
``[pairs]`` (precomputed reference log-probs) replace the reference's forward
pass. Prompt and padding positions are never counted: only positions where a
completion mask is True are summed.

The reference's log-probs are computed in the loss, not in ``prepare`` as the
RL families compute theirs: each pair is seen by one update (DPO makes one
pass over a batch), so a prepare phase would run the same forward passes and
add a compiled program, a dispatch and a stored batch per step; the
reference's pass carries no gradient, so XLA keeps none of its activations.
Precomputed ``ref_chosen_logps`` / ``ref_rejected_logps`` (TRL's
``precompute_ref_log_probs``) skip it altogether. Initialisation, the
reference, the token checks and export are the LM-policy core's
(:mod:`dew.objectives.cores.policy`); the log line prints ``accuracy`` and ``margin``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import FLOATS, IDS, MASK, BatchField, first_row
from dew.objectives.contract.objective import Objective, Role, Step
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import masked_sum, sequence_logprobs
from dew.objectives.cores.policy import CausalPolicy, check_chunked_model, policy_of
from dew.objectives.preference.losses import dpo_losses, orpo_losses, simpo_losses

LOSSES = ("sigmoid", "cdpo", "ipo", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
KEYS = ("chosen", "chosen_mask", "rejected", "rejected_mask")
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


@registry.register("dpo")
@dataclasses.dataclass(frozen=True, eq=False)
class DPOObjective(Objective):
    """Preference optimization of a causal policy against a frozen reference.

    model: the policy, a causal module ``model.apply(variables, ids) -> [batch, length,
      vocab]`` (``dew.nn.backbones.CausalTransformer``).
    reference: the reference's parameters; None = a copy of the initial policy
      (``init_params`` when given, as DPO after SFT expects). Kept as the frozen
      role ``"reference"`` (``TrainState.frozen['reference']``), never optimized;
      its shapes are checked against ``reference_model`` before compiling.
    reference_model: the reference's module; None = ``model``. Must have the
      policy's vocabulary.
    reference_free: no reference at all (``ref_w = ref_l = 0``); no frozen role.
    beta: the inverse temperature of the implicit reward (TRL and the paper's
      default 0.1).
    loss_type: ``"sigmoid"`` (DPO), ``"cdpo"`` (``label_smoothing`` > 0 required),
      ``"ipo"`` (TRL's name; ``loss`` is the objective's method), ``"simpo"`` or
      ``"orpo"`` (reference-free; ``beta`` is ORPO's ``lambda``).
    label_smoothing: the assumed probability ``eps`` in [0, 0.5) that a label is
      flipped (cDPO); 0 = plain DPO. Not with ``"ipo"``.
    rpo_alpha: weight of the NLL of the chosen completions (RPO); 0 = off.
    simpo_gamma: SimPO's target margin ``gamma`` (the paper's and TRL's 0.5);
      ``loss_type="simpo"`` only.
    init_params: start the policy from these parameters (a ``Pretrained`` load,
      an SFT run) instead of a random initialisation.
    tokenizer: for previews and the exported pipeline; None = ``ByteTokenizer()``.
    keys: the batch keys ``(chosen, chosen_mask, rejected, rejected_mask)``.
    logits_chunk_size: the policy (and a reference run in the loss) score the ids this
      many positions of every row at a time
      (:func:`dew.objectives.cores.logprobs.sequence_logprobs`),
      never holding the ``[rows, length, vocab]`` float32 logits whole; None (the
      default) = the whole logits. Needs models that take it
      (:class:`dew.nn.CausalTransformer`).
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    reference: Any = None
    reference_model: Any = None
    reference_free: bool = False
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    simpo_gamma: float = 0.5
    init_params: Any = None
    tokenizer: Any = None
    keys: tuple[str, str, str, str] = KEYS
    logits_chunk_size: int | None = None

    headline_metrics = ("accuracy", "margin")  # printed on the log line

    def __post_init__(self):
        if self.loss_type not in LOSSES:
            raise ValueError(
                f"DPOObjective(loss_type={self.loss_type!r}): use one of {list(LOSSES)}"
            )
        if not self.beta > 0:
            raise ValueError(f"DPOObjective needs beta > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(
                f"DPOObjective label_smoothing must be in [0, 0.5) (the probability a label is "
                f"flipped), got {self.label_smoothing}"
            )
        if self.loss_type == "cdpo" and self.label_smoothing == 0:
            raise ValueError(
                "DPOObjective(loss_type='cdpo') needs label_smoothing > 0 (e.g. 0.1); with 0 "
                "it is loss_type='sigmoid'"
            )
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ValueError(
                f"DPOObjective(loss_type='ipo') takes no label_smoothing (got "
                f"{self.label_smoothing}); use loss_type='cdpo' for noisy labels"
            )
        if self.rpo_alpha < 0:
            raise ValueError(f"DPOObjective rpo_alpha must be >= 0, got {self.rpo_alpha}")
        if self.loss_type in REFERENCE_FREE_LOSSES:
            if self.reference is not None or self.reference_model is not None:
                raise ValueError(
                    f"DPOObjective(loss_type={self.loss_type!r}) is reference-free: the reference "
                    f"is unused; drop reference= and reference_model="
                )
            if self.loss_type == "orpo" and (self.label_smoothing or self.rpo_alpha):
                raise ValueError(
                    "DPOObjective(loss_type='orpo') takes no label_smoothing or rpo_alpha (its "
                    "NLL term on the chosen is built in); drop them"
                )
        if self.simpo_gamma != 0.5 and self.loss_type != "simpo":
            raise ValueError(
                f"DPOObjective: simpo_gamma is SimPO's margin; with loss_type="
                f"{self.loss_type!r} it is unused (got {self.simpo_gamma})"
            )
        if self.reference_free and (self.reference is not None or self.reference_model):
            raise ValueError(
                "DPOObjective(reference_free=True) uses no reference; drop reference= and "
                "reference_model="
            )
        if self.reference_model is not None and self.reference is None:
            raise ValueError(
                "DPOObjective(reference_model=...) needs the reference's weights too "
                "(reference=params); a reference is a trained model, not a random init"
            )
        reference_model = self.policy.reference_model  # tokenizer and vocabularies checked
        check_chunked_model(self.model, self.logits_chunk_size, what="DPOObjective")
        if self.uses_reference:
            check_chunked_model(
                reference_model,
                self.logits_chunk_size,
                what="DPOObjective reference_model",
            )

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core: policy, tokenizer, initial weights, reference and its
        module (``reference_model`` or the policy's)."""
        return policy_of(self)

    # ------------------------------------------------------------- roles, init
    @property
    def uses_reference(self) -> bool:
        """A frozen reference role: not with ``reference_free`` nor SimPO / ORPO."""
        return not self.reference_free and self.loss_type not in REFERENCE_FREE_LOSSES

    def roles(self) -> tuple[Role, ...]:
        policy = Role(name="policy", module=self.model)
        if not self.uses_reference:
            return (policy,)
        # without reference weights the reference is the initial policy (declared)
        initial = "policy" if self.reference is None else None
        return (
            policy,
            Role(
                name="reference",
                module=self.policy.reference_model,
                trained=False,
                initial_from=initial,
            ),
        )

    def batch_fields(self):
        ids = [BatchField(k, ("length",), IDS if k in self.keys[::2] else MASK) for k in self.keys]
        return (*ids, *(BatchField(k, (), FLOATS, required=False) for k in REF_KEYS))

    def init(self, key, spec=None):
        chosen = self.keys[0]
        if spec is not None and chosen in spec:
            length = int(tuple(spec[chosen].shape)[0])
        else:
            length = int(getattr(self.model, "max_seq_len", 8))
        params = self.policy.init_policy(key, length)
        variables = {"params": {"policy": params}}
        if self.uses_reference:  # the initial policy, or the given reference
            variables["reference"] = {"params": self.policy.init_reference(key, length, params)}
        return variables

    # ------------------------------------------------------------------ loss
    def logps(self, variables, batch):
        """Sequence log-probs ``(policy [pairs, 2], reference [pairs, 2] or None,
        chosen token NLL sum, chosen token count)``; column 0 chosen, 1 rejected."""
        chosen, chosen_mask, rejected, rejected_mask = (batch[k] for k in self.keys)
        pairs, length = chosen.shape
        # Interleave [c0, r0, c1, r1, ...]: each device's rows stay on it under a
        # batch-sharded mesh, and one forward pass scores both completions.
        ids = jnp.stack([chosen, rejected], axis=1).reshape(2 * pairs, length)
        mask = jnp.stack([chosen_mask, rejected_mask], axis=1).reshape(2 * pairs, length)
        chunk = self.logits_chunk_size
        tokens = sequence_logprobs(
            self.model, variables["params"]["policy"], ids, logits_chunk_size=chunk
        )  # [2 pairs, length]
        policy = masked_sum(tokens, mask).reshape(pairs, 2)
        chosen_tokens = tokens.reshape(pairs, 2, length)[:, 0]
        nll_sum = -masked_sum(chosen_tokens, chosen_mask)  # [pairs]
        count = jnp.sum(chosen_mask.astype(jnp.float32), axis=-1)
        if not self.uses_reference:
            reference = jnp.zeros_like(policy)
        elif all(k in batch for k in REF_KEYS):
            reference = jnp.stack([batch[k].astype(jnp.float32) for k in REF_KEYS], axis=1)
        else:
            ref_tokens = sequence_logprobs(
                self.policy.reference_model,
                variables["reference"]["params"],
                ids,
                logits_chunk_size=chunk,
            )
            reference = masked_sum(ref_tokens, mask).reshape(pairs, 2)
        return policy, jax.lax.stop_gradient(reference), nll_sum, count

    def pair_losses(self, h: jax.Array) -> jax.Array:
        """The DPO / cDPO / IPO loss of each pair from ``h [pairs]`` (module docstring)."""
        loss_type = "ipo" if self.loss_type == "ipo" else "sigmoid"  # cdpo: label smoothing
        return dpo_losses(
            h, beta=self.beta, loss_type=loss_type, label_smoothing=self.label_smoothing
        )

    def reference_free_losses(self, policy, batch):
        """SimPO's or ORPO's per-pair losses and implicit rewards ``beta avg [pairs, 2]``
        from the summed log-probs ``policy [pairs, 2]``."""
        _, chosen_mask, _, rejected_mask = (batch[k] for k in self.keys)
        counts = jnp.stack(
            [jnp.sum(m.astype(jnp.float32), axis=-1) for m in (chosen_mask, rejected_mask)], axis=1
        )
        avg = policy / jnp.maximum(counts, 1.0)  # [pairs, 2]
        if self.loss_type == "simpo":
            losses = simpo_losses(
                avg[:, 0],
                avg[:, 1],
                beta=self.beta,
                gamma=self.simpo_gamma,
                label_smoothing=self.label_smoothing,
            )
        else:
            losses = orpo_losses(avg[:, 0], avg[:, 1], lam=self.beta)
        return losses, jax.lax.stop_gradient(self.beta * avg)

    def _terms(self, variables, batch):
        policy, reference, nll_sum, count = self.logps(variables, batch)
        h = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])  # [pairs]
        rows = (
            batch["example_mask"].astype(jnp.float32)
            if "example_mask" in batch
            else jnp.ones(h.shape, jnp.float32)
        )
        if self.loss_type in REFERENCE_FREE_LOSSES:
            losses, rewards = self.reference_free_losses(policy, batch)
        else:
            losses = self.pair_losses(h)
            rewards = jax.lax.stop_gradient(self.beta * (policy - reference))  # [pairs, 2]
        margin = rewards[:, 0] - rewards[:, 1]
        loss = Weighted.mean(losses, rows)
        metrics = {
            "dpo_loss": loss,
            "reward_chosen": Weighted.mean(rewards[:, 0], rows),
            "reward_rejected": Weighted.mean(rewards[:, 1], rows),
            "margin": Weighted.mean(margin, rows),
            "accuracy": Weighted.mean((margin > 0).astype(jnp.float32), rows),
            "logp_chosen": Weighted.mean(jax.lax.stop_gradient(policy[:, 0]), rows),
            "logp_rejected": Weighted.mean(jax.lax.stop_gradient(policy[:, 1]), rows),
            "pairs": Summed(jnp.sum(rows)),
        }
        nll = Weighted(total=jnp.sum(nll_sum * rows), weight=jnp.sum(count * rows))
        metrics["nll_chosen"] = Weighted(total=jax.lax.stop_gradient(nll.total), weight=nll.weight)
        return loss, nll, metrics

    def loss(self, variables, batch, step: Step):
        loss, nll, metrics = self._terms(variables, batch)
        if self.loss_type == "orpo":  # the SFT term on the chosen, weight 1
            return (loss, nll), metrics
        if self.rpo_alpha:
            return (loss, nll.scale(self.rpo_alpha)), metrics
        return loss, metrics

    def evaluate(self, variables, batch, step: Step):
        loss, _, metrics = self._terms(variables, batch)
        return {"loss": loss, **{k: v for k, v in metrics.items() if k != "dpo_loss"}}

    def preview(self, variables, key):
        return self.policy.preview(variables["params"]["policy"], key)

    def export(self, variables):
        return self.policy.export(variables["params"]["policy"])

    # ------------------------------------------------------------ bad input
    def check_batch(self, batch):
        super().check_batch(batch)  # the declared fields: keys, one [pairs, length], dtypes
        chosen_key, chosen_mask_key, rejected_key, rejected_mask_key = self.keys
        chosen, rejected = np.asarray(batch[chosen_key]), np.asarray(batch[rejected_key])
        c_mask = np.asarray(batch[chosen_mask_key]).astype(bool)
        r_mask = np.asarray(batch[rejected_mask_key]).astype(bool)
        self.policy.check_positions(
            chosen.shape[1],
            where=f"rows of batch[{chosen_key!r}] ({chosen.shape[1]} ids)",
            fix="shorten prompt_len + completion_len",
        )
        for name, ids in ((chosen_key, chosen), (rejected_key, rejected)):
            self.policy.check_ids(ids, key=name)
        rows = np.asarray(batch.get("example_mask", np.ones(len(chosen), bool))).astype(bool)
        for name, mask in ((chosen_key, c_mask), (rejected_key, r_mask)):
            if found := first_row(mask[:, 0]):
                raise ValueError(
                    f"DPOObjective: pair {found[0]}'s {name} completion starts at position 0, so "
                    f"its first token has no context to be scored in; give every pair a prompt "
                    f"(at least a start-of-text id)"
                )
            if found := first_row(rows & ~mask.any(axis=1)):
                raise ValueError(
                    f"DPOObjective: pair {found[0]} of this batch has an empty {name} completion "
                    f"after the prompt ({found[1]} such pairs); drop such pairs in the data (or "
                    f"raise PreferencePairs' prompt_len + completion_len)"
                )
        same = (c_mask == r_mask).all(axis=1) & (
            np.where(c_mask, chosen, -1) == np.where(r_mask, rejected, -1)
        ).all(axis=1)
        if found := first_row(same & rows):
            row, count = found
            ids = chosen[row][c_mask[row]].tolist()[:16]
            raise ValueError(
                f"DPOObjective: pair {row} of this batch has identical chosen and rejected "
                f"completions ({count} such pairs; ids {ids}); a pair without a preference has "
                f"no gradient and no accuracy: drop ties in the data"
            )
        present = [k for k in REF_KEYS if k in batch]
        if len(present) == 1:
            raise ValueError(
                f"DPOObjective: the batch has {present[0]!r} but not its partner; precomputed "
                f"reference log-probs need both {list(REF_KEYS)}"
            )
