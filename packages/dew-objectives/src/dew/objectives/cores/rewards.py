"""Rewards of completions: jittable functions of token arrays and host Python
functions over decoded text, weighted and summed.

    r_i = sum_k w_k r_k(o_i)

Two kinds, called once per rollout batch, each reported as its own metric
(``reward/<name>``) next to the weighted sum (``reward``):

- :class:`TokenReward`: ``fn(completion, completion_mask, batch) -> [rows]``,
  traced into the compiled rollout. ``completion`` int32 ``[rows, new]``,
  ``completion_mask`` bool ``[rows, new]`` (True on the new tokens, an end id
  included), ``batch`` the prompt batch with every key repeated per
  completion (``prompt``, ``prompt_mask``, the reader's ``answer``...).
- :class:`TextReward`: ``fn(prompts, completions, **columns) -> [rows]``, on
  the host, between the compiled rollout and the compiled advantages.
  ``prompts`` and ``completions`` are lists of decoded strings (a
  completion's end id removed); ``columns`` the reader's other keys, one
  entry per completion: an integer key with a ``<key>_mask`` companion (the
  ``dew.data.Prompts`` reader's ``answer``) decoded to a string, any other
  key its numpy row. ``fn`` receives the columns its signature names (all
  of them with ``**kwargs``), TRL's convention for reward functions.

A plain callable in ``rewards=[...]`` is a :class:`TextReward` of weight 1.

A reward that returns the wrong shape, a non-finite value, or raises stops
the step before any update with a :class:`RewardError` naming the function
and the prompt (``prompt b``, ``sample g of its group``).

Rewards of generated images (Flow-GRPO) follow the same protocol, ``r_i = sum_k w_k
r_k(x_i)``, jitted or on the host:

- :class:`ImageReward`: ``fn(images, batch) -> [rows]``, traced into the compiled
  rollout; ``images`` uint8 ``[rows, H, W, C]`` (``pixels=True``) or the float
  samples as drawn (latents, 2-D points).
- :class:`HostImageReward`: ``fn(images, **columns) -> [rows]`` on the host, once per
  rollout batch, between the compiled rollout and the compiled advantages (a
  detector, OCR, a model served elsewhere); a plain callable is one of weight 1.

Its errors name the sample (``sample 9 (condition 1 of the batch, sample 1 of its
group of 8)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.diffusion.pipelines import to_pixels

READER = "data/"
"""Prefix of the reader's other keys (``answer``...) inside a rollout batch."""


class RewardError(ValueError):
    """A reward function failed, returned the wrong shape or a non-finite value."""


def _name_of(fn: Callable, name: str) -> str:
    return name or getattr(fn, "__name__", None) or type(fn).__name__


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenReward:
    """A jittable reward of token arrays, traced into the compiled rollout.

    fn: ``fn(completion int32[rows, new], completion_mask bool[rows, new], batch)
      -> float[rows]``; ``batch`` holds the prompt batch's keys, each row
      repeated per completion.
    weight: its coefficient in the summed reward.
    name: the metric name (``reward/<name>``); "" = ``fn.__name__``.
    """

    fn: Callable
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        check_reward(self)

    @property
    def label(self) -> str:
        return _name_of(self.fn, self.name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextReward:
    """A host Python reward over decoded text, called once per rollout batch.

    fn: ``fn(prompts: list[str], completions: list[str], **columns) -> sequence of
      rows floats`` (see the module docstring for ``columns``).
    weight: its coefficient in the summed reward.
    name: the metric name (``reward/<name>``); "" = ``fn.__name__``.
    """

    fn: Callable
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        check_reward(self)

    @property
    def label(self) -> str:
        return _name_of(self.fn, self.name)


def check_reward(reward) -> None:
    kind = type(reward).__name__
    if not callable(reward.fn):
        raise TypeError(f"{kind}.fn must be callable, got {type(reward.fn).__name__}")
    if not math.isfinite(reward.weight):
        raise ValueError(f"{kind} {reward.label!r}: weight must be finite, got {reward.weight}")
    label = reward.label
    if not label or "/" in label or label.strip() != label:
        raise ValueError(
            f"{kind} name {label!r} is not usable as a metric name; give name='...' "
            f"without '/' or surrounding spaces"
        )


def gather_rewards(rewards, kinds: tuple[type, ...], plain: type, *, hint: str) -> tuple:
    """``rewards=[...]`` (or one reward) as a tuple of ``kinds`` instances, a plain
    callable wrapped as ``plain(fn=...)``; none, another type or a repeated name is an
    error (``hint``: what to pass)."""
    if callable(rewards) or isinstance(rewards, kinds):
        rewards = [rewards]
    items = []
    for r in rewards:
        if isinstance(r, kinds):
            items.append(r)
        elif callable(r):
            items.append(plain(fn=r))
        else:
            names = " or ".join(k.__name__ for k in kinds)
            raise TypeError(
                f"a reward must be a {names} or a callable (a {plain.__name__}), got "
                f"{type(r).__name__} {r!r:.60}"
            )
    if not items:
        raise ValueError(f"no rewards given; pass {hint}")
    names = [r.label for r in items]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"reward names {twice} appear more than once ({names}); give each its own "
            f"name=... (they are metric names)"
        )
    return tuple(items)


def where(row: int, group_size: int) -> str:
    """``"completion r (prompt b, sample g of its group of G)"`` for row ``r``."""
    b, g = divmod(row, group_size)
    return f"completion {row} (prompt {b} of the batch, sample {g} of its group of {group_size})"


@dataclasses.dataclass(frozen=True)
class RewardSet:
    """An objective's rewards in order, each with its name and weight: what
    :class:`Rewards` (completions) and :class:`ImageRewards`
    (images) share. Each subclass builds one with its ``of``."""

    items: tuple[Any, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The metric names (``reward/<name>``), in order."""
        return tuple(r.label for r in self.items)

    @property
    def weights(self) -> np.ndarray:
        """``[rewards]`` float32 coefficients, in :attr:`names` order."""
        return np.asarray([r.weight for r in self.items], np.float32)

    def total(self, values: jax.Array) -> jax.Array:
        """``[rows]`` ``sum_k w_k r_k`` of ``values [rows, rewards]``."""
        return values @ jnp.asarray(self.weights)


@dataclasses.dataclass(frozen=True)
class Rewards(RewardSet):
    """The rewards of an objective, in order: token rewards and text rewards,
    each with its weight. Build with :meth:`of`."""

    items: tuple[TokenReward | TextReward, ...]

    @classmethod
    def of(cls, rewards: Sequence[Any]) -> Rewards:
        """From ``rewards=[...]``: :class:`TokenReward`, :class:`TextReward`, or plain
        callables (text rewards of weight 1)."""
        return cls(
            gather_rewards(
                rewards,
                (TokenReward, TextReward),
                TextReward,
                hint="rewards=[TokenReward(fn=...)] or [TextReward(fn=...)] (a plain callable "
                "is a text reward)",
            )
        )

    @property
    def token(self) -> tuple[TokenReward, ...]:
        return tuple(r for r in self.items if isinstance(r, TokenReward))

    @property
    def text(self) -> tuple[TextReward, ...]:
        return tuple(r for r in self.items if isinstance(r, TextReward))

    # ------------------------------------------------------------- compiled
    def token_values(self, completion, completion_mask, batch) -> jax.Array:
        """``[rows, token rewards]`` float32, traced; a function returning another
        shape is a :class:`RewardError` at trace time (before compiling)."""
        rows = completion.shape[0]
        columns = []
        for r in self.token:
            value = jnp.asarray(r.fn(completion, completion_mask, batch))
            if value.shape != (rows,):
                raise RewardError(
                    f"token reward {r.label!r} returned shape {value.shape}; it must return "
                    f"one value per completion, shape ({rows},)"
                )
            columns.append(value.astype(jnp.float32))
        if not columns:
            return jnp.zeros((rows, 0), jnp.float32)
        return jnp.stack(columns, axis=1)

    # ---------------------------------------------------------------- host
    def host_stage(
        self, rollout: Mapping[str, np.ndarray], tokenizer, *, end_ids=(), group_size: int = 1
    ) -> dict[str, np.ndarray]:
        """The host part of a rollout's rewards (``Objective.prepare_host``): checks the
        token rewards (``rollout['token_rewards']``), calls each text reward once over
        the decoded prompts and completions and the reader's columns (keys under
        :data:`READER`); returns ``{'rewards': [rows, rewards]}`` float32 in
        :attr:`names` order."""
        token = np.asarray(rollout["token_rewards"], np.float32)
        self.check_token_values(token, group_size)
        text = np.zeros((token.shape[0], 0), np.float32)
        if self.text:
            prompts = decode_rows(tokenizer, rollout["prompt"], rollout["prompt_mask"])
            completions = decode_rows(
                tokenizer, rollout["completion"], rollout["completion_mask"], end_ids
            )
            data = {k[len(READER) :]: v for k, v in rollout.items() if k.startswith(READER)}
            text = self.text_values(prompts, completions, text_columns(tokenizer, data), group_size)
        t, h = iter(token.T), iter(text.T)
        columns = [next(t) if isinstance(r, TokenReward) else next(h) for r in self.items]
        return {"rewards": np.stack(columns, axis=1).astype(np.float32)}

    def check_token_values(self, values: np.ndarray, group_size: int) -> None:
        """Raise :class:`RewardError` at the first non-finite token-reward value."""
        for k, r in enumerate(self.token):
            _check_finite(values[:, k], f"token reward {r.label!r}", group_size)

    def text_values(
        self,
        prompts: list[str],
        completions: list[str],
        columns: Mapping[str, list],
        group_size: int,
    ) -> np.ndarray:
        """``[rows, text rewards]`` float32: each text reward called once over the
        batch; its result checked for shape and finiteness."""
        rows = len(completions)
        out = np.zeros((rows, len(self.text)), np.float32)
        for k, r in enumerate(self.text):
            kwargs = accepted_columns(r.fn, columns)
            what = f"text reward {r.label!r}"
            try:
                value = r.fn(prompts=prompts, completions=completions, **kwargs)
            except Exception as error:
                row = _first_failing_row(r.fn, prompts, completions, kwargs)
                at = where(row, group_size) if row is not None else f"a batch of {rows} rows"
                raise RewardError(
                    f"{what} raised {type(error).__name__}: {error} on {at}; the step was not "
                    f"applied. Fix the function (it gets prompts=, completions= and the "
                    f"columns {sorted(columns)})\n{traceback.format_exc(limit=-3)}"
                ) from error
            try:
                value = np.asarray(value, np.float64)
            except (TypeError, ValueError) as error:
                raise RewardError(
                    f"{what} returned {type(value).__name__}, which is not a sequence of "
                    f"numbers ({error}); return one float per completion ({rows})"
                ) from error
            if value.shape != (rows,):
                raise RewardError(
                    f"{what} returned shape {value.shape} for {rows} completions; return one "
                    f"float per completion, shape ({rows},); the step was not applied"
                )
            _check_finite(value, what, group_size)
            out[:, k] = value
        return out


def _check_finite(value: np.ndarray, what: str, group_size: int) -> None:
    bad = np.flatnonzero(~np.isfinite(value))
    if bad.size:
        row = int(bad[0])
        raise RewardError(
            f"{what} returned {value[row]} for {where(row, group_size)} ({bad.size} non-finite "
            f"value(s) in the batch); the step was not applied. Rewards must be finite"
        )


def accepted_columns(fn: Callable, columns: Mapping[str, list]) -> dict[str, list]:
    """The columns ``fn`` takes: all with ``**kwargs``, else those it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return dict(columns)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(columns)
    named = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in named}


def _first_failing_row(fn, prompts, completions, kwargs) -> int | None:
    """The first row on which ``fn`` alone raises, or None (it fails only on the batch)."""
    for row in range(len(completions)):
        try:
            fn(
                prompts=prompts[row : row + 1],
                completions=completions[row : row + 1],
                **{k: v[row : row + 1] for k, v in kwargs.items()},
            )
        except Exception:
            return row
    return None


def decode_rows(tokenizer, ids: np.ndarray, mask: np.ndarray, end_ids=()) -> list[str]:
    """Each row's ids where ``mask`` is True, end ids removed, decoded to text."""
    end = set(int(e) for e in end_ids)
    out = []
    for row, keep in zip(np.asarray(ids), np.asarray(mask, bool)):
        out.append(tokenizer.decode([int(t) for t in row[keep] if int(t) not in end]))
    return out


def text_columns(
    tokenizer, batch: Mapping[str, np.ndarray], *, skip: Sequence[str] = ()
) -> dict[str, list]:
    """The reader's columns as a text reward receives them: an integer key with a
    ``<key>_mask`` companion decoded to strings, any other key its rows (numpy
    rows, Python scalars for one value per row); masks and ``skip`` left out."""
    out: dict[str, list] = {}
    for key, value in batch.items():
        if key in skip or (key.endswith("_mask") and key[: -len("_mask")] in batch):
            continue
        value = np.asarray(value)
        mask = batch.get(f"{key}_mask")
        if mask is not None and np.issubdtype(value.dtype, np.integer):
            out[key] = decode_rows(tokenizer, value, np.asarray(mask))
        elif value.ndim == 1:
            out[key] = value.tolist()
        else:
            out[key] = list(value)
    return out


# ------------------------------------------------------------ rewards of images
def pixels_of(x: jax.Array) -> jax.Array:
    """Samples in ``[-1, 1]`` as uint8 pixels ``round((x + 1) 127.5)`` clipped (traced)."""
    return jnp.clip(jnp.round((x.astype(jnp.float32) + 1.0) * 127.5), 0, 255).astype(jnp.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageReward:
    """A jittable reward of samples, traced into the compiled rollout.

    fn: ``fn(images, batch) -> float[rows]``; ``images`` uint8 ``[rows, H, W, C]``
      (``pixels=True``) or the float32 samples as drawn (latents, points); ``batch``
      every key of the data batch (the label too), each row repeated per group sample.
    weight: its coefficient in the summed reward.
    name: the metric name (``reward/<name>``); "" = ``fn.__name__``.
    pixels: give ``fn`` uint8 pixels (True) or the float samples (False).
    """

    fn: Callable
    weight: float = 1.0
    name: str = ""
    pixels: bool = True

    def __post_init__(self):
        check_reward(self)

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", None) or type(self.fn).__name__


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostImageReward(ImageReward):
    """A host Python reward (a detector, OCR, a model served elsewhere), called once per
    rollout batch between the compiled rollout and the compiled advantages.

    fn: ``fn(images: np.ndarray, **columns) -> sequence of rows floats``; ``images``
      as :class:`ImageReward`'s (numpy); ``columns`` every key of the data batch,
      numpy rows repeated per group sample (those ``fn``'s signature names, all with
      ``**kwargs``).
    """


def image_where(row: int, group_size: int) -> str:
    """``"sample r (condition b of the batch, sample g of its group of G)"``."""
    b, g = divmod(row, group_size)
    return f"sample {row} (condition {b} of the batch, sample {g} of its group of {group_size})"


def _check_values(value: np.ndarray, rows: int, what: str, group_size: int) -> np.ndarray:
    if value.shape != (rows,):
        raise RewardError(
            f"{what} returned shape {value.shape} for {rows} samples; return one float per "
            f"sample, shape ({rows},); the step was not applied"
        )
    bad = np.flatnonzero(~np.isfinite(value))
    if bad.size:
        row = int(bad[0])
        raise RewardError(
            f"{what} returned {value[row]} for {image_where(row, group_size)} ({bad.size} "
            f"non-finite value(s) in the batch); the step was not applied. Rewards must be finite"
        )
    return value


@dataclasses.dataclass(frozen=True)
class ImageRewards(RewardSet):
    """An objective's image rewards in order, each with its weight (:meth:`of`)."""

    items: tuple[ImageReward, ...]

    @classmethod
    def of(cls, rewards) -> ImageRewards:
        """From ``rewards=[...]``: :class:`ImageReward`, :class:`HostImageReward` or plain
        callables (host rewards of weight 1)."""
        return cls(
            gather_rewards(
                rewards,
                (ImageReward,),
                HostImageReward,
                hint="rewards=[ImageReward(fn=...)] (jittable) or [HostImageReward(fn=...)] "
                "(host Python; a plain callable is one)",
            )
        )

    @property
    def compiled(self) -> tuple[ImageReward, ...]:
        return tuple(r for r in self.items if not isinstance(r, HostImageReward))

    @property
    def host(self) -> tuple[HostImageReward, ...]:
        return tuple(r for r in self.items if isinstance(r, HostImageReward))

    def compiled_values(self, samples: jax.Array, batch) -> jax.Array:
        """``[rows, compiled rewards]`` float32, traced; another shape is a
        :class:`RewardError` when traced (before compiling)."""
        rows = samples.shape[0]
        columns = []
        for r in self.compiled:
            try:
                value = jnp.asarray(r.fn(pixels_of(samples) if r.pixels else samples, batch))
            except Exception as error:  # traced: no sample to name, the batch's shapes
                raise RewardError(
                    f"image reward {r.label!r} raised {type(error).__name__}: {error} while "
                    f"traced on samples of shape {tuple(samples.shape)}; nothing was applied. "
                    f"It must be a jittable function fn(images, batch) -> [rows] (a host "
                    f"Python reward is a HostImageReward)"
                ) from error
            if value.shape != (rows,):
                raise RewardError(
                    f"image reward {r.label!r} returned shape {value.shape}; it must return "
                    f"one value per sample, shape ({rows},)"
                )
            columns.append(value.astype(jnp.float32))
        return jnp.stack(columns, axis=1) if columns else jnp.zeros((rows, 0), jnp.float32)

    def host_stage(self, samples, compiled, columns, group_size: int) -> np.ndarray:
        """``[rows, rewards]`` float32 in :attr:`names` order: the compiled values checked,
        each host reward called once and checked (a :class:`RewardError` names the
        function and the sample)."""
        rows = samples.shape[0]
        compiled = np.asarray(compiled, np.float32)
        for k, r in enumerate(self.compiled):
            _check_values(compiled[:, k], rows, f"image reward {r.label!r}", group_size)
        host = []
        for r in self.host:
            images = to_pixels(samples) if r.pixels else np.asarray(samples, np.float32)
            kwargs = accepted_columns(r.fn, columns)
            what = f"host image reward {r.label!r}"
            try:
                value = r.fn(images, **kwargs)
            except Exception as error:
                row = _first_failing_image_row(r.fn, images, kwargs)
                at = (
                    image_where(row, group_size)
                    if row is not None
                    else f"a batch of {rows} samples"
                )
                raise RewardError(
                    f"{what} raised {type(error).__name__}: {error} on {at}; the step was not "
                    f"applied\n{traceback.format_exc(limit=-3)}"
                ) from error
            try:
                value = np.asarray(value, np.float64)
            except (TypeError, ValueError) as error:
                raise RewardError(
                    f"{what} returned {type(value).__name__}, not a sequence of numbers "
                    f"({error}); return one float per sample ({rows})"
                ) from error
            host.append(_check_values(value, rows, what, group_size).astype(np.float32))
        c, h = iter(compiled.T), iter(host)
        cols = [next(h) if isinstance(r, HostImageReward) else next(c) for r in self.items]
        return np.stack(cols, axis=1).astype(np.float32)


def _first_failing_image_row(fn, images, kwargs) -> int | None:
    for row in range(images.shape[0]):
        try:
            fn(images[row : row + 1], **{k: v[row : row + 1] for k, v in kwargs.items()})
        except Exception:
            return row
    return None


def check_reward_model(reward_model, reward_model_params, policy_vocab, *, what: str) -> None:
    """A frozen reward model (``reward_model=``, ``reward_model_params=``) comes with
    its weights and reads the policy's token ids (one vocabulary), or a ValueError."""
    if (reward_model is None) != (reward_model_params is None):
        raise ValueError(
            f"{what}: reward_model= and reward_model_params= come together (a trained reward "
            f"model and its weights)"
        )
    vocab = getattr(reward_model, "vocab_size", None)
    if reward_model is not None and vocab != policy_vocab:
        raise ValueError(
            f"{what}: the reward model's vocabulary has {vocab} ids, the policy's "
            f"{policy_vocab}; the reward model reads the policy's token ids, so both need "
            f"one tokenizer"
        )


def no_host_rewards(rollout) -> dict[str, np.ndarray]:
    """The host stage of an objective whose only judge is a reward model:
    ``{'rewards': [rows, 0]}``."""
    return {"rewards": np.zeros((len(rollout["prompt"]), 0), np.float32)}


def reward_roles(reward_model) -> tuple:
    """The frozen role ``"reward"`` of a reward model given to an RL family, or none."""
    from dew.objectives.contract.objective import Role

    if reward_model is None:
        return ()
    return (Role(name="reward", module=reward_model, trained=False),)


def reward_model_scores(reward_model, variables, rollout) -> jax.Array:
    """``[rows]`` float32: the frozen role ``"reward"`` (``variables['reward']``) scoring
    each rollout row as a reward model reads it, the prompt then the completion, right
    padded (:func:`dew.objectives.cores.rollouts.right_aligned`). Traced, in prepare."""
    from dew.objectives.cores.rollouts import right_aligned

    ids, real = right_aligned(rollout)
    scores = reward_model.apply({"params": variables["reward"]["params"]}, ids, real)
    return scores.astype(jnp.float32)
