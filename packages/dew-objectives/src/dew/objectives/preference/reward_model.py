"""A Bradley-Terry reward model: a causal backbone with a scalar head on the
last non-padding token (Ouyang et al. 2022, InstructGPT, section 3.5; TRL's
``RewardTrainer``; Hugging Face's ``...ForSequenceClassification`` with
``num_labels=1``), trained on preference pairs.

For a pair ``(x, y_w, y_l)`` the model scores each sequence ``r = w .
h_last(x, y)`` (``h_last``: the backbone's final hidden state, after its
output norm, at the sequence's last real token; ``w``: the head, no bias, as
Hugging Face's ``score``) and the loss per pair is
:func:`dew.objectives.preference.losses.bradley_terry_losses`::

    -log sigmoid(r_w - r_l - margin) + c (r_w + r_l)^2

a :class:`Weighted` mean over pairs. Metrics: ``accuracy`` (``1[r_w > r_l]``),
``margin`` (``r_w - r_l``), ``reward_chosen``, ``reward_rejected``.

Batches are :class:`dew.data.PreferencePairs`' (right-padded: prompt,
completion, padding); the last real token of a row is the last True of
``prompt_mask | <side>_mask``. A left-padded row is refused (the head would
read a padding position).

``export`` gives a :class:`RewardScorer`: the module, its parameters and the
tokenizer, scoring ``(prompt, completion)`` texts on the host, or token
arrays inside a compiled program (:meth:`RewardScorer.score_tokens`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn import CausalTransformer, models
from dew.objectives.contract import registry
from dew.objectives.contract.batch import FLOATS, IDS, MASK, BatchField, first_row
from dew.objectives.contract.objective import Objective, Role, Step, with_initial_values
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.policy import CausalPolicy, causal_policy
from dew.objectives.preference.losses import bradley_terry_losses

KEYS = ("chosen", "chosen_mask", "rejected", "rejected_mask", "prompt_mask")


def last_real_index(mask: jax.Array) -> jax.Array:
    """``[rows]`` the index of each row's last True in ``mask [rows, length]``
    (right padding); 0 for an empty row."""
    length = mask.shape[1]
    positions = jnp.arange(length)[None, :]
    return jnp.max(jnp.where(mask, positions, 0), axis=1)


@models.register("causal_reward_model")
class CausalRewardModel(CausalTransformer):
    """A :class:`dew.nn.CausalTransformer` (its options, its parameters: ``embed``,
    ``layers``, ``final_norm``, ``lm_head``) with a scalar head ``score`` (no bias,
    Hugging Face's ``...ForSequenceClassification`` with ``num_labels=1``) on the final
    hidden state of each row's last real token: ``(ids [rows, length], mask [rows,
    length]) -> [rows]`` float32. Registered as ``"causal_reward_model"``, so a run's
    checkpoint rebuilds it (``load_model(directory, role="reward")``)."""

    def setup(self):
        self.score = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.normal(0.02))

    def __call__(self, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        _, hidden = super().__call__(ids, return_hidden=True)  # [rows, length, embed]
        if mask is None:
            mask = jnp.ones(ids.shape, bool)
        last = last_real_index(mask)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [rows, embed]
        return self.score(h.astype(jnp.float32))[:, 0].astype(jnp.float32)

    @classmethod
    def of(cls, backbone: CausalTransformer) -> CausalRewardModel:
        """The reward model of ``backbone``'s configuration."""
        if not isinstance(backbone, CausalTransformer):
            raise TypeError(
                f"a reward model needs a dew.nn.CausalTransformer backbone, got "
                f"{type(backbone).__qualname__}"
            )
        if isinstance(backbone, cls):
            return backbone
        return cls(
            **{
                f.name: getattr(backbone, f.name)
                for f in dataclasses.fields(backbone)
                if f.init and f.name not in ("parent", "name")
            }
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardScorer:
    """A trained reward model: ``scorer(prompts, completions) -> [rows]`` float32 on
    the host (texts through ``tokenizer``, right-padded to ``max_len``), or
    :meth:`score_tokens` on id arrays inside a compiled program."""

    module: CausalRewardModel
    params: Any
    tokenizer: Any
    max_len: int

    def score_tokens(self, params, ids: jax.Array, mask: jax.Array) -> jax.Array:
        """Rewards ``[rows]`` of right-padded ``ids`` (``mask`` True on real tokens)."""
        return self.module.apply({"params": params}, ids, mask)

    def __call__(self, prompts, completions) -> np.ndarray:
        rows = len(prompts)
        ids = np.zeros((rows, self.max_len), np.int32)
        mask = np.zeros((rows, self.max_len), bool)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            tokens = list(self.tokenizer.encode(p)) + list(self.tokenizer.encode(c))
            tokens = tokens[-self.max_len :]
            ids[r, : len(tokens)], mask[r, : len(tokens)] = tokens, True
        return np.asarray(jax.jit(self.score_tokens)(self.params, ids, mask))


@registry.register("reward_model")
@dataclasses.dataclass(frozen=True, eq=False)
class RewardModelObjective(Objective):
    """Train a Bradley-Terry reward model on preference pairs (module docstring).

    model: the causal backbone (:class:`dew.nn.CausalTransformer`); the objective
      trains ``CausalRewardModel.of(model)`` (the role ``"reward"``).
    init_params: the backbone's starting weights (a ``Pretrained`` load, an SFT
      policy's parameters), or a reward model's (with ``score``); a head not given
      starts at random. None = a fresh model.
    margin: subtracted from every pair's reward gap (a float); 0 = none.
    center_rewards_coefficient: TRL's, ``c (r_w + r_l)^2``; 0 = off.
    tokenizer: for :meth:`export`; None = ``ByteTokenizer()``.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    init_params: Any = None
    margin: float = 0.0
    center_rewards_coefficient: float = 0.0
    tokenizer: Any = None

    headline_metrics = ("accuracy", "margin")

    def __post_init__(self):
        if self.center_rewards_coefficient < 0:
            raise ValueError(
                f"RewardModelObjective center_rewards_coefficient must be >= 0, got "
                f"{self.center_rewards_coefficient}"
            )
        self.backbone  # noqa: B018  (checks the tokenizer and vocabulary now)
        self.reward_model  # noqa: B018  (a CausalTransformer backbone)

    @functools.cached_property
    def backbone(self) -> CausalPolicy:
        """The backbone's token checks and tokenizer."""
        return causal_policy(
            model=self.model, what="RewardModelObjective", tokenizer=self.tokenizer
        )

    @functools.cached_property
    def reward_model(self) -> CausalRewardModel:
        return CausalRewardModel.of(self.model)

    def roles(self):
        return (Role(name="reward", module=self.reward_model),)

    def batch_fields(self):
        kinds = {"chosen": IDS, "rejected": IDS}
        return tuple(BatchField(k, ("length",), kinds.get(k, MASK)) for k in KEYS) + (
            BatchField("margin", (), FLOATS, required=False),
        )

    def init(self, key, spec=None):
        length = int(tuple(spec[KEYS[0]].shape)[0]) if spec and KEYS[0] in spec else 8
        ids = jnp.zeros((1, length), jnp.int32)
        params = self.reward_model.init(key, ids, jnp.ones((1, length), bool))["params"]
        if self.init_params is not None:
            given = nn.unbox(self.init_params.get("params", self.init_params))
            given = {**given, "score": given.get("score", nn.unbox(params["score"]))}
            params = with_initial_values(params, given, what="RewardModelObjective init_params")
        return {"params": {"reward": params}}

    def rewards(self, params, batch) -> jax.Array:
        """``[pairs, 2]`` rewards of the chosen (column 0) and rejected sequences."""
        chosen, chosen_mask, rejected, rejected_mask, prompt_mask = (batch[k] for k in KEYS)
        pairs, length = chosen.shape
        ids = jnp.stack([chosen, rejected], axis=1).reshape(2 * pairs, length)
        real = jnp.stack([chosen_mask | prompt_mask, rejected_mask | prompt_mask], axis=1)
        return self.reward_model.apply(
            {"params": params}, ids, real.reshape(2 * pairs, length)
        ).reshape(pairs, 2)

    def _terms(self, variables, batch):
        rewards = self.rewards(variables["params"]["reward"], batch)
        rows = (
            batch["example_mask"].astype(jnp.float32)
            if "example_mask" in batch
            else jnp.ones(rewards.shape[:1], jnp.float32)
        )
        margin = batch.get("margin", self.margin)
        losses = bradley_terry_losses(
            rewards[:, 0],
            rewards[:, 1],
            margin=margin,
            center_coefficient=self.center_rewards_coefficient,
        )
        loss = Weighted.mean(losses, rows)
        fixed = jax.lax.stop_gradient(rewards)
        gap = fixed[:, 0] - fixed[:, 1]
        metrics = {
            "reward_loss": loss,
            "accuracy": Weighted.mean((gap > 0).astype(jnp.float32), rows),
            "margin": Weighted.mean(gap, rows),
            "reward_chosen": Weighted.mean(fixed[:, 0], rows),
            "reward_rejected": Weighted.mean(fixed[:, 1], rows),
            "pairs": Summed(jnp.sum(rows)),
        }
        return loss, metrics

    def loss(self, variables, batch, step: Step):
        return self._terms(variables, batch)

    def evaluate(self, variables, batch, step: Step):
        loss, metrics = self._terms(variables, batch)
        return {"loss": loss, **{k: v for k, v in metrics.items() if k != "reward_loss"}}

    def export(self, variables):
        return RewardScorer(
            module=self.reward_model,
            params=variables["params"]["reward"],
            tokenizer=self.backbone.tokenizer,
            max_len=int(getattr(self.model, "max_seq_len", None) or 512),
        )

    def check_batch(self, batch):
        super().check_batch(batch)
        prompt = np.asarray(batch["prompt_mask"]).astype(bool)
        rows = np.asarray(batch.get("example_mask", np.ones(len(prompt), bool))).astype(bool)
        for side in ("chosen", "rejected"):
            ids = np.asarray(batch[side])
            self.backbone.check_ids(ids, key=side)
            real = prompt | np.asarray(batch[f"{side}_mask"]).astype(bool)
            right_padded = (np.cumsum(~real, axis=1) == 0) == real
            if found := first_row(rows & ~right_padded.all(axis=1)):
                raise ValueError(
                    f"RewardModelObjective: row {found[0]} of batch[{side!r}] is not right-padded "
                    f"({found[1]} such rows): the scalar head reads each row's last real token, "
                    f"which Dew's readers put before the padding (PreferencePairs pads on the "
                    f"right); left-padded data (a Hugging Face tokenizer with "
                    f"padding_side='left') must be re-padded on the right"
                )
            if found := first_row(rows & ~np.asarray(batch[f"{side}_mask"]).astype(bool).any(1)):
                raise ValueError(
                    f"RewardModelObjective: pair {found[0]} has an empty {side} completion "
                    f"({found[1]} such pairs); drop them in the data"
                )


# ------------------------------------------------ Hugging Face ...ForSequenceClassification
def _backbone(model: CausalRewardModel) -> CausalTransformer:
    fields = dataclasses.fields(CausalTransformer)
    init = {
        f.name: getattr(model, f.name)
        for f in fields
        if f.init and f.name not in ("parent", "name")
    }
    return CausalTransformer(**init)


def _classification_architecture(architecture: str) -> str:
    for suffix in ("ForCausalLM", "LMHeadModel"):
        if architecture.endswith(suffix):
            return architecture[: -len(suffix)] + "ForSequenceClassification"
    raise ValueError(f"no ...ForSequenceClassification class is known for {architecture!r}")


def save_hf_reward_model(
    path, model: CausalRewardModel, params, *, family: str, pad_id: int = 0
) -> pathlib.Path:
    """Write a reward model as the Hugging Face ``...ForSequenceClassification``
    (``num_labels=1``) of ``family`` (``"llama"``, ``"qwen2"``, ``"mistral"``,
    ``"gpt2"``, ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"``): the causal LM's
    tensors without ``lm_head``, plus ``score.weight`` ``[1, hidden]``; ``config.json``
    names the class and ``pad_token_id`` (transformers finds each row's last real token
    from it). The tokenizer is not written."""
    from dew.nn import hf
    from dew.sampling.checkpoint_io.files import write_tensors

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fmt = hf.get(family)
    params = nn.unbox(params)
    backbone = _backbone(model)
    tensors = fmt.params_to_hf({k: v for k, v in params.items() if k != "score"}, backbone)
    tensors.pop("lm_head.weight", None)
    tensors["score.weight"] = np.asarray(params["score"]["kernel"], np.float32).T
    dtype = str(next(iter(tensors.values())).dtype)
    config = fmt.config_from_dew(backbone, base=None, dtype_name=dtype)
    config.update(
        architectures=[_classification_architecture(fmt.architecture)],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=int(pad_id),
    )
    write_tensors(path, tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


def load_hf_reward_model(path, *, use_scan: bool = True) -> tuple[CausalRewardModel, Any]:
    """``(model, params)`` of a Hugging Face ``...ForSequenceClassification`` with one
    label, of a causal family Dew reads (``config.json`` and ``*.safetensors``). Rows
    it scores must be right-padded (the last real token is read from the mask)."""
    from dew.nn import hf
    from dew.sampling.checkpoint_io.files import TensorReader

    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{path}: config.json names {architectures}, not a ...ForSequenceClassification; "
            f"a causal LM loads with dew.sampling.Pretrained.load"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {0: None}))
    if labels != 1:
        raise ValueError(
            f"{path}: a reward model has one label (a scalar score), this has {labels}"
        )
    fmt = hf.get(hf.family_of(config, str(path)))
    causal = {k: v for k, v in config.items() if k not in ("id2label", "label2id", "num_labels")}
    causal["architectures"] = [fmt.architecture]
    name, options = fmt.config_to_dew(
        causal, where=str(path), ignore_fields=("problem_type", "pad_token_id")
    )
    backbone = models.build(name, **options, use_scan=use_scan)
    tensors = dict(TensorReader(path))
    score = np.asarray(tensors.pop("score.weight"), np.float32)  # [1, hidden]
    if not backbone.tie_embeddings and "lm_head.weight" not in tensors:
        # a classifier has no LM head; the backbone's stays unused (never read by the score)
        tensors["lm_head.weight"] = np.zeros((backbone.vocab_size, score.shape[1]), np.float32)
    params = dict(fmt.params_from_hf(tensors, backbone, where=str(path)))
    params["score"] = {"kernel": jnp.asarray(score.T)}
    return CausalRewardModel.of(backbone), params
