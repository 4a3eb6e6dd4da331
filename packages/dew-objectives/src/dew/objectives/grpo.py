"""Group Relative Policy Optimization (GRPO; Shao et al. 2024, DeepSeekMath,
arXiv 2402.03300, section 4).

Per prompt ``q`` the policy samples ``G`` completions ``o_1..o_G`` (a group);
each gets a reward ``r_i = sum_k w_k r_k(o_i)`` (:mod:`dew.objectives.rewards`).
The advantage of every token of ``o_i`` is its reward against the group's:

    A_i = (r_i - mean(r)) / (std(r) + eps)     scale_rewards="group" (paper; std ddof=1)
    A_i = (r_i - mean(r)) / (std(R) + eps)     "batch": std over the whole rollout batch
    A_i =  r_i - mean(r)                       "none" (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783)

and a group whose rewards are all equal has ``A = 0`` exactly (it carries no
signal; its share is logged as ``zero_variance_fraction``). The loss minimizes

    l_{i,t} = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta k3_{i,t}
    rho     = pi_theta(o_t | q, o_<t) / pi_old(o_t | q, o_<t)
    k3      = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1      (float32, log-ratio clamped)

aggregated over the completion tokens (``loss_aggregation``):

- ``"sequence-mean"`` (the paper): ``mean_i (1/|o_i|) sum_t l_{i,t}`` (length-biased);
- ``"token-mean"`` (DAPO, TRL's ``"dapo"``/``"bnpo"``): ``sum_{i,t} l / sum_i |o_i|``;
- ``"dr_grpo"``: ``sum_{i,t} l / (rows * max_new_tokens)``.

Each is a :class:`~dew.objectives.Weighted` mean, so microbatches and devices
divide once by the global weight.

The on-policy contract (``docs/concepts.md``): the rollout runs in the
trainer's prepare phase, compiled, on the pre-update weights, with
:func:`dew.sampling.decode`; its ``old_logps`` and ``ref_logps`` come from
:func:`dew.objectives.rollouts.rollout_logprobs`, the function the loss
calls, with the sampler's temperature and truncation, so the first update's
``rho`` is 1 (asserted with ``check_first_ratio=True`` or ``DEW_DEBUG=1``).
Text rewards run on the host between the compiled rollout and the compiled
advantages (:meth:`Objective.prepare_host`). ``prepared_updates`` runs
several updates (epochs x minibatches) over one rollout batch; after the
first, ``rho != 1`` and the clip acts (``clip_fraction``).

Metrics: ``reward`` and ``reward/<name>`` per reward, ``zero_variance_fraction``
(groups with identical rewards), ``clip_fraction`` (tokens where the clip is
active: ``rho < 1 - eps_low`` with ``A < 0`` or ``rho > 1 + eps_high`` with
``A > 0``), ``ratio``, ``kl`` (k3, with ``beta > 0``), ``completion_length``,
``tokens``; the log adds ``rollout_tokens_per_second``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.base import Objective, Role, Step, Updates, with_initial_values
from dew.objectives.logprobs import kl_k3
from dew.objectives.rewards import Rewards, TokenReward, decode_rows, text_columns
from dew.objectives.rollouts import (
    Rollout,
    check_first_ratio,
    debug_enabled,
    in_chunks,
    repeat_rows,
    rollout_logprobs,
    sample_completions,
)
from dew.objectives.weighted import Summed, Weighted
from dew.sampling import Sampling

SCALE_REWARDS = ("group", "batch", "none")
LOSS_AGGREGATION = ("sequence-mean", "token-mean", "dr_grpo")
_PROMPT_KEYS = ("prompt", "prompt_mask")
_DATA = "data/"  # prefix of the reader's other keys inside the rollout


def group_advantages(
    rewards: jax.Array, group_size: int, *, scale_rewards: str = "group", eps: float = 1e-4
) -> tuple[jax.Array, jax.Array]:
    """Group-relative advantages of ``rewards [rows]`` (rows ``b * G + g``).

    Returns ``(advantages [rows], zero_variance [rows])``: ``zero_variance`` is 1.0
    on the rows of a group whose rewards are all equal, whose advantages are 0
    exactly. Standard deviations are unbiased (ddof=1), as in Tunix and TRL.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = rewards.astype(jnp.float32)
    groups = rewards.reshape(-1, group_size)  # [prompts, group]
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    constant = jnp.max(groups, axis=1) == jnp.min(groups, axis=1)  # [prompts]
    if scale_rewards == "group":
        centred = centred / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (jnp.std(rewards, ddof=1) + eps)
    advantages = jnp.where(constant[:, None], 0.0, centred)
    zero = jnp.broadcast_to(constant[:, None], groups.shape).astype(jnp.float32)
    return advantages.reshape(-1), zero.reshape(-1)


def clipped_objective(
    logps: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    *,
    epsilon_low: float,
    epsilon_high: float,
):
    """Per token ``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``, ``rho`` and
    whether the clip is active. ``logps``/``old_logps [rows, new]``, ``advantages [rows]``."""
    ratio = jnp.exp(logps.astype(jnp.float32) - old_logps.astype(jnp.float32))
    adv = advantages[:, None].astype(jnp.float32)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    active = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    return -jnp.minimum(unclipped, clipped), ratio, active


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str) -> Weighted:
    """``per_token [rows, new]`` over the completion tokens as a :class:`Weighted`
    mean (``loss_aggregation``, module docstring)."""
    mask = mask.astype(jnp.float32)
    total = per_token * mask
    if mode == "sequence-mean":
        per_row = jnp.sum(total, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return Weighted.mean(per_row)
    if mode == "token-mean":
        return Weighted(total=jnp.sum(total), weight=jnp.sum(mask))
    if mode == "dr_grpo":
        rows, new = per_token.shape
        return Weighted(total=jnp.sum(total) / new, weight=jnp.float32(rows))
    raise ValueError(f"loss_aggregation must be one of {LOSS_AGGREGATION}, got {mode!r}")


@dataclasses.dataclass(eq=False)
class GRPOObjective(Objective):
    """GRPO on a causal language model (module docstring for the math).

    model: the policy, a causal module that decodes with a KV cache
      (:class:`dew.nn.CausalTransformer`).
    rewards: :class:`~dew.objectives.rewards.TokenReward` /
      :class:`~dew.objectives.rewards.TextReward` objects (a plain callable is a
      text reward of weight 1), weighted and summed.
    group_size: completions per prompt, ``G >= 2``.
    max_new_tokens: completion length, in tokens.
    sampling: how completions are drawn (temperature, top-k/p, min-p); the
      loss's log-probs use the same. Not greedy: a group would be identical.
    end_ids: ids that end a completion (counted in it); () = none.
    pad_id: fills completions after their end.
    epsilon: the clip range below 1 (and above, unless ``epsilon_high``).
    epsilon_high: the clip range above 1 (DAPO's clip-higher); None = ``epsilon``.
    beta: weight of the k3 KL to the reference; 0 = no reference policy at all.
    kl_clamp: the log-ratio ``log pi_ref - log pi`` is clipped to ``+-kl_clamp``
      before k3's exponential (float32 overflow, Tunix's ``kl_clamp_value``).
    scale_rewards: ``"group"`` | ``"batch"`` | ``"none"`` (Dr.GRPO).
    advantage_eps: added to the standard deviation (TRL's 1e-4).
    loss_aggregation: ``"sequence-mean"`` | ``"token-mean"`` | ``"dr_grpo"``.
    prepared_updates: updates per rollout batch (:class:`~dew.objectives.Updates`);
      the default is one (the paper's: rho = 1, no clipping).
    reference: the frozen reference policy's parameters (another run's, a
      Hugging Face load); None = a copy of the initial policy.
    init_params: start the policy from these parameters instead of a random init.
    tokenizer: decodes prompts, completions and answers for text rewards and
      the exported pipeline; None = ``ByteTokenizer()``.
    check_first_ratio: assert ``max |rho - 1| <= 1e-6`` on every first update
      (:func:`dew.objectives.rollouts.check_first_ratio`); None = ``DEW_DEBUG=1``.
    scoring_rows: rows per forward pass when prepare scores its rollouts
      (:func:`dew.objectives.rollouts.in_chunks`); None = the rows of one update
      (``rows / minibatches``), so the loss's first forward pass has the rollout
      scoring's shapes and the first update's ratio is 1 bit for bit. With
      ``Trainer(accumulate=k)`` give the microbatch's rows.
    """

    model: Any
    rewards: Sequence[Any] = ()
    group_size: int = 8
    max_new_tokens: int = 16
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    end_ids: tuple[int, ...] = ()
    pad_id: int = 0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.04
    kl_clamp: float = 20.0
    scale_rewards: str = "group"
    advantage_eps: float = 1e-4
    loss_aggregation: str = "sequence-mean"
    prepared_updates: Updates = dataclasses.field(default_factory=Updates)
    reference: Any = None
    init_params: Any = None
    tokenizer: Any = None
    check_first_ratio: bool | None = None
    scoring_rows: int | None = None

    def __post_init__(self):
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(f"group_size must be an int, got {self.group_size!r}")
        if self.group_size < 2:
            raise ValueError(
                f"GRPOObjective needs group_size >= 2 completions per prompt (advantages are "
                f"rewards against the group's mean), got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 tokens, got {self.max_new_tokens}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {self.sampling!r}")
        if self.sampling.is_greedy:
            raise ValueError(
                f"GRPOObjective samples its groups; {self.sampling} is greedy, so every "
                f"completion of a group would be the same. Use a temperature > 0"
            )
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if not 0 < self.epsilon < 1 or not high > 0:
            raise ValueError(
                f"epsilon must be in (0, 1) and epsilon_high > 0, got epsilon={self.epsilon}, "
                f"epsilon_high={self.epsilon_high}"
            )
        if self.beta < 0:
            raise ValueError(f"beta (the KL weight) must be >= 0, got {self.beta}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}"
            )
        if self.loss_aggregation not in LOSS_AGGREGATION:
            raise ValueError(
                f"loss_aggregation must be one of {LOSS_AGGREGATION}, got {self.loss_aggregation!r}"
            )
        if self.scoring_rows is not None and (
            isinstance(self.scoring_rows, bool) or self.scoring_rows < 1
        ):
            raise ValueError(f"scoring_rows must be >= 1 rows or None, got {self.scoring_rows!r}")
        if not isinstance(self.prepared_updates, Updates):
            raise TypeError(
                f"prepared_updates must be dew.objectives.Updates(epochs=, minibatches=), got "
                f"{self.prepared_updates!r}"
            )
        self.end_ids = tuple(int(e) for e in self.end_ids)
        self.reward_set = Rewards.of(self.rewards)
        if self.tokenizer is None:
            from dew.data import ByteTokenizer

            self.tokenizer = ByteTokenizer()
        self.debug = debug_enabled(self.check_first_ratio)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    # ----------------------------------------------------------------- roles
    def roles(self):
        roles = [Role(name="model", module=self.model)]
        if self.beta > 0:
            roles.append(Role(name="reference", module=self.model, trained=False))
        return tuple(roles)

    def _check_prompt_len(self, prompt_len: int, where: str) -> None:
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and prompt_len + self.max_new_tokens > max_len:
            raise ValueError(
                f"{where}: prompts of {prompt_len} tokens plus max_new_tokens="
                f"{self.max_new_tokens} need {prompt_len + self.max_new_tokens} positions, more "
                f"than the model's max_seq_len {max_len}; use prompts of at most "
                f"{max_len - self.max_new_tokens} tokens (Prompts(prompt_len=...)) or fewer "
                f"new tokens"
            )

    def init(self, key, spec=None):
        length = self.max_new_tokens
        if spec is not None and "prompt" in spec:
            prompt_len = int(tuple(spec["prompt"].shape)[0])
            self._check_prompt_len(prompt_len, "the data's batch['prompt']")
            length += prompt_len
        dummy = jnp.zeros((1, length), jnp.int32)
        params = self.model.init(key, dummy)["params"]
        if self.init_params is not None:
            params = with_initial_values(params, self.init_params, what="GRPOObjective init_params")
        variables = {"params": params}
        if self.beta > 0:
            if self.reference is None:
                # the initial policy: the same arrays (under LoRA the trainer makes it a
                # view of the base, stored nowhere)
                variables["reference"] = {"params": params}
            else:
                ref = self.model.init(key, dummy)["params"]
                ref = with_initial_values(ref, self.reference, what="GRPOObjective reference")
                variables["reference"] = {"params": ref}
        return variables

    # --------------------------------------------------------------- prepare
    def prepare(self, variables, batch, step: Step):
        """Rollouts (compiled): ``G`` completions per prompt, old and reference
        log-probs, token rewards; the reader's other keys repeated per completion."""
        params = variables["params"]
        rollout = sample_completions(
            self.model,
            params,
            batch["prompt"],
            batch["prompt_mask"],
            key=step.key,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            group_size=self.group_size,
            end_ids=self.end_ids,
            pad_id=self.pad_id,
        )
        out = dict(rollout.as_dict())
        # in chunks of one update's rows: the loss then scores the same shapes. The policy and
        # the reference score each chunk in one loop iteration (half the loop trips of two maps)
        chunk = self.scoring_rows or rollout.prompt.shape[0] // self.prepared_updates.minibatches
        scored = {"old_logps": params}
        if self.beta > 0:
            scored["ref_logps"] = variables["reference"]["params"]

        def scores(r):
            return {
                name: rollout_logprobs(self.model, p, r, sampling=self.sampling)
                for name, p in scored.items()
            }

        out.update(in_chunks(scores, rollout, chunk))
        data = {
            k: repeat_rows(v, self.group_size) for k, v in batch.items() if k not in _PROMPT_KEYS
        }
        seen = {**data, "prompt": rollout.prompt, "prompt_mask": rollout.prompt_mask}
        out["token_rewards"] = self.reward_set.token_values(
            rollout.completion, rollout.completion_mask, seen
        )
        out.update({_DATA + k: v for k, v in data.items()})
        return out

    def prepare_host(self, rollout):
        """Host stage: checks the token rewards, calls the text rewards once over the
        decoded batch; returns every reward, ``rewards [rows, rewards]``."""
        g = self.group_size
        rewards = self.reward_set
        token = np.asarray(rollout["token_rewards"], np.float32)
        rewards.check_token_values(token, g)
        rows = token.shape[0]
        text = np.zeros((rows, 0), np.float32)
        if rewards.text:
            prompts = decode_rows(self.tokenizer, rollout["prompt"], rollout["prompt_mask"])
            completions = decode_rows(
                self.tokenizer, rollout["completion"], rollout["completion_mask"], self.end_ids
            )
            data = {k[len(_DATA) :]: v for k, v in rollout.items() if k.startswith(_DATA)}
            columns = text_columns(self.tokenizer, data)
            text = rewards.text_values(prompts, completions, columns, g)
        t, h = iter(token.T), iter(text.T)
        columns = [next(t) if isinstance(r, TokenReward) else next(h) for r in rewards.items]
        return {"rewards": np.stack(columns, axis=1).astype(np.float32)}

    def prepare_finish(self, variables, batch, step: Step):
        """Advantages (compiled) from the summed rewards; the training batch."""
        rewards = batch["rewards"]  # [rows, rewards]
        total = self.reward_set.total(rewards)  # [rows]
        advantages, zero = group_advantages(
            total, self.group_size, scale_rewards=self.scale_rewards, eps=self.advantage_eps
        )
        keep = ("prompt", "prompt_mask", "completion", "completion_mask", "old_logps", "ref_logps")
        out = {k: batch[k] for k in keep if k in batch}
        out.update(rewards=rewards, reward=total, advantages=advantages, zero_variance=zero)
        return out

    # ------------------------------------------------------------------ loss
    def loss(self, variables, batch, step: Step):
        rollout = Rollout.from_batch(batch)
        mask = rollout.completion_mask
        logps = rollout_logprobs(
            self.model, variables["params"], rollout, sampling=self.sampling
        )  # [rows, new]
        per_token, ratio, active = clipped_objective(
            logps,
            batch["old_logps"],
            batch["advantages"],
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_upper,
        )
        updates = self.prepared_updates
        if self.debug:
            check_first_ratio(
                ratio,
                mask,
                step=step.index,
                updates_per_batch=updates.per_batch,
                what=type(self).__name__,
            )
        metrics = {}
        if self.beta > 0:
            kl = kl_k3(logps, batch["ref_logps"], clamp=self.kl_clamp)  # [rows, new] float32
            per_token = per_token + self.beta * kl
            metrics["kl"] = Weighted.mean(kl, mask)
        loss = aggregate(per_token, mask, self.loss_aggregation)
        tokens = jnp.sum(mask, dtype=jnp.float32)
        first_epoch = (step.index % updates.per_batch) < updates.minibatches
        metrics.update(
            reward=Weighted.mean(batch["reward"]),
            zero_variance_fraction=Weighted.mean(batch["zero_variance"]),
            clip_fraction=Weighted.mean(active, mask),
            ratio=Weighted.mean(ratio, mask),
            completion_length=Weighted.mean(rollout.lengths),
            tokens=Summed(tokens),
            rollout_tokens=Summed(jnp.where(first_epoch, tokens, 0.0)),
        )
        for k, name in enumerate(self.reward_set.names):
            metrics[f"reward/{name}"] = Weighted.mean(batch["rewards"][:, k])
        return loss, metrics

    # ---------------------------------------------------------- validation
    def check_batch(self, batch):
        for key in _PROMPT_KEYS:
            if key not in batch:
                raise KeyError(
                    f"GRPOObjective needs batch[{key!r}] (left-padded prompts, as "
                    f"dew.data.Prompts reads them); the batch has keys {sorted(batch)}"
                )
        prompt = np.asarray(batch["prompt"])
        if prompt.ndim != 2 or np.shape(batch["prompt_mask"]) != prompt.shape:
            raise ValueError(
                f"batch['prompt'] must be [rows, prompt_len] with a prompt_mask of the same "
                f"shape, got {prompt.shape} and {np.shape(batch['prompt_mask'])}"
            )
        self._check_prompt_len(prompt.shape[1], "batch['prompt']")
        rows = prompt.shape[0] * self.group_size
        if self.scoring_rows and rows % self.scoring_rows:
            raise ValueError(
                f"a rollout batch of {rows} rows ({prompt.shape[0]} prompts x group_size "
                f"{self.group_size}) does not split into chunks of scoring_rows="
                f"{self.scoring_rows}; use a divisor of {rows}"
            )
        vocab = getattr(self.model, "vocab_size", None)
        if vocab is not None and prompt.size and (prompt.max() >= vocab or prompt.min() < 0):
            raise ValueError(
                f"batch['prompt'] holds token ids in [{prompt.min()}, {prompt.max()}], outside "
                f"the model's vocabulary of {vocab}; check the tokenizer matches the model"
            )

    def export(self, variables):
        from dew.sampling import TextGeneration

        return TextGeneration(
            self.model,
            variables["params"],
            self.tokenizer,
            max_new_tokens=self.max_new_tokens,
            end_ids=self.end_ids or None,
        )
