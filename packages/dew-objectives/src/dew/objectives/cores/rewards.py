"""Rewards of rollouts: one :class:`Reward` type for every RL family, of a causal
LM's completions (tokens or decoded text) or of a diffusion model's images, jitted or
on the host, weighted and summed:

    r_i = sum_k w_k r_k(o_i)

A :class:`Reward` is a function, its weight, its metric name (``reward/<name>``, next
to the weighted sum ``reward``) and where it runs: ``host=False`` traces it into the
compiled rollout; ``host=True`` calls it on the host once per rollout batch, between
the compiled rollout and the compiled advantages (decoded text, a detector, OCR, a
model served elsewhere). What ``fn`` receives is the family's:

- completions (GRPO, PPO, online DPO; :class:`Rewards`): jitted,
  ``fn(completion, completion_mask, batch) -> [rows]`` (``completion`` int32
  ``[rows, new]``, ``completion_mask`` bool, True on the new tokens, an end id
  included; ``batch`` the prompt batch, every key repeated per completion); on the
  host, ``fn(prompts, completions, **columns)`` over decoded strings (a completion's
  end id removed) and the reader's other keys, one entry per completion (an integer
  key with a ``<key>_mask`` companion, the ``dew.data.Prompts`` reader's ``answer``,
  decoded to a string; any other key its numpy row);
- images (Flow-GRPO; :class:`ImageRewards`): jitted, ``fn(images, batch)``; on the
  host, ``fn(images, **columns)``; ``images`` uint8 ``[rows, H, W, C]``
  (``pixels=True``) or the float samples as drawn (latents, 2-D points).

A host ``fn`` receives the columns its signature names (all of them with
``**kwargs``), TRL's convention for reward functions. A plain callable in
``rewards=[...]`` is a host reward of weight 1. The kinds keep their names as
constructors of a :class:`Reward`: :func:`TokenReward` and :func:`TextReward`
(jitted / host, of completions), :func:`ImageReward` and :func:`HostImageReward`
(of images).

A reward that returns the wrong shape, a non-finite value, or raises stops the step
before any update with a :class:`RewardError` naming the function and the row
(``completion 5 (prompt 1 of the batch, sample 1 of its group of 4)``, ``sample 9
(condition 1 of the batch, sample 1 of its group of 8)``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.diffusion.pipelines import to_pixels

READER = "data/"
"""Prefix of the reader's other keys (``answer``...) inside a rollout batch."""


class RewardError(ValueError):
    """A reward function failed, returned the wrong shape or a non-finite value."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reward:
    """One reward of a rollout (module docstring).

    fn: the function; its arguments are the family's and depend on ``host``.
    weight: its coefficient in the summed reward.
    name: the metric name (``reward/<name>``); "" = ``fn.__name__``.
    host: False = jitted, traced into the compiled rollout; True = host Python, called
      once per rollout batch between the compiled rollout and the advantages.
    pixels: of images only: ``fn`` gets uint8 pixels (True) or the float samples.
    """

    fn: Callable
    weight: float = 1.0
    name: str = ""
    host: bool = False
    pixels: bool = True

    def __post_init__(self):
        check_reward(self)

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", None) or type(self.fn).__name__


def TokenReward(*, fn: Callable, weight: float = 1.0, name: str = "") -> Reward:  # noqa: N802
    """A jitted reward of completions, ``fn(completion, completion_mask, batch)``."""
    return Reward(fn=fn, weight=weight, name=name)


def TextReward(*, fn: Callable, weight: float = 1.0, name: str = "") -> Reward:  # noqa: N802
    """A host reward of decoded completions, ``fn(prompts, completions, **columns)``."""
    return Reward(fn=fn, weight=weight, name=name, host=True)


def ImageReward(  # noqa: N802
    *, fn: Callable, weight: float = 1.0, name: str = "", pixels: bool = True
) -> Reward:
    """A jitted reward of images, ``fn(images, batch)``."""
    return Reward(fn=fn, weight=weight, name=name, pixels=pixels)


def HostImageReward(  # noqa: N802
    *, fn: Callable, weight: float = 1.0, name: str = "", pixels: bool = True
) -> Reward:
    """A host reward of images, ``fn(images, **columns)``."""
    return Reward(fn=fn, weight=weight, name=name, pixels=pixels, host=True)


def check_reward(reward: Reward) -> None:
    if not callable(reward.fn):
        raise TypeError(f"Reward.fn must be callable, got {type(reward.fn).__name__}")
    if not math.isfinite(reward.weight):
        raise ValueError(f"Reward {reward.label!r}: weight must be finite, got {reward.weight}")
    label = reward.label
    if not label or "/" in label or label.strip() != label:
        raise ValueError(
            f"Reward name {label!r} is not usable as a metric name; give name='...' "
            f"without '/' or surrounding spaces"
        )


def gather_rewards(rewards, *, hint: str) -> tuple[Reward, ...]:
    """``rewards=[...]`` (or one reward) as a tuple of :class:`Reward`, a plain callable
    a host reward of weight 1; none, another type or a repeated name is an error
    (``hint``: what to pass)."""
    if callable(rewards) or isinstance(rewards, Reward):
        rewards = [rewards]
    items = []
    for r in rewards:
        if isinstance(r, Reward):
            items.append(r)
        elif callable(r):
            items.append(Reward(fn=r, host=True))
        else:
            raise TypeError(
                f"a reward must be a Reward or a callable (a host reward), got "
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


def where(row: int, group_size: int, item: str = "completion", group: str = "prompt") -> str:
    """``"completion r (prompt b of the batch, sample g of its group of G)"`` for row ``r``."""
    b, g = divmod(row, group_size)
    return f"{item} {row} ({group} {b} of the batch, sample {g} of its group of {group_size})"


@dataclasses.dataclass(frozen=True)
class Rewards:
    """An objective's rewards of completions in order, each with its weight (:meth:`of`):
    the jitted ones traced into the rollout (:meth:`token_values`), the host ones
    over decoded text (:meth:`host_stage`)."""

    items: tuple[Reward, ...]

    # how the messages name a row, and what a jitted / host reward is called
    item: ClassVar[str] = "completion"
    group: ClassVar[str] = "prompt"
    kinds: ClassVar[tuple[str, str]] = ("token reward", "text reward")

    @classmethod
    def of(cls, rewards: Sequence[Any]):
        """From ``rewards=[...]``: :class:`Reward` objects or plain callables (host
        rewards of weight 1)."""
        return cls(
            gather_rewards(
                rewards,
                hint="rewards=[Reward(fn=...)] (jitted; host=True: host Python; a plain "
                "callable is a host reward)",
            )
        )

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

    @property
    def jitted(self) -> tuple[Reward, ...]:
        return tuple(r for r in self.items if not r.host)

    @property
    def host(self) -> tuple[Reward, ...]:
        return tuple(r for r in self.items if r.host)

    # ------------------------------------------------------------- compiled
    def jitted_values(self, call: Callable[[Reward], Any], rows: int, traced: str) -> jax.Array:
        """``[rows, jitted rewards]`` float32 of ``call(reward)`` (traced); a function
        that raises or returns another shape is a :class:`RewardError` at trace time
        (``traced``: what it was traced on, for the message)."""
        columns = []
        for r in self.jitted:
            what = f"{self.kinds[0]} {r.label!r}"
            try:
                value = jnp.asarray(call(r))
            except Exception as error:  # traced: no row to name, the batch's shapes
                raise RewardError(
                    f"{what} raised {type(error).__name__}: {error} while traced on "
                    f"{traced}; nothing was applied. A jitted reward must be traceable (a "
                    f"host Python reward is Reward(host=True))"
                ) from error
            if value.shape != (rows,):
                raise RewardError(
                    f"{what} returned shape {value.shape}; it must return one value per "
                    f"{self.item}, shape ({rows},)"
                )
            columns.append(value.astype(jnp.float32))
        return jnp.stack(columns, axis=1) if columns else jnp.zeros((rows, 0), jnp.float32)

    def token_values(self, completion, completion_mask, batch) -> jax.Array:
        """``[rows, jitted rewards]`` of the completions, traced."""
        return self.jitted_values(
            lambda r: r.fn(completion, completion_mask, batch),
            completion.shape[0],
            f"completions of shape {tuple(completion.shape)}",
        )

    # ---------------------------------------------------------------- host
    def checked(self, value, rows: int, what: str, group_size: int) -> np.ndarray:
        """``value`` as ``[rows]`` float64, or a :class:`RewardError` naming ``what`` and
        the first non-finite row."""
        try:
            value = np.asarray(value, np.float64)
        except (TypeError, ValueError) as error:
            raise RewardError(
                f"{what} returned {type(value).__name__}, which is not a sequence of "
                f"numbers ({error}); return one float per {self.item} ({rows})"
            ) from error
        if value.shape != (rows,):
            raise RewardError(
                f"{what} returned shape {value.shape} for {rows} {self.item}s; return one "
                f"float per {self.item}, shape ({rows},); the step was not applied"
            )
        bad = np.flatnonzero(~np.isfinite(value))
        if bad.size:
            row = int(bad[0])
            at = where(row, group_size, self.item, self.group)
            raise RewardError(
                f"{what} returned {value[row]} for {at} ({bad.size} non-finite value(s) in "
                f"the batch); the step was not applied. Rewards must be finite"
            )
        return value

    def host_values(
        self,
        jitted: np.ndarray,
        arguments: Callable[[Reward], tuple[tuple, dict]],
        columns: Mapping[str, Any],
        group_size: int,
    ) -> np.ndarray:
        """``[rows, rewards]`` float32 in :attr:`names` order: ``jitted [rows, jitted
        rewards]`` checked, each host reward called once as ``fn(*args, **kwargs,
        **columns it takes)`` (``args, kwargs = arguments(reward)``, the family's; every
        argument and column one entry per row) and checked."""
        jitted = np.asarray(jitted, np.float32)
        rows = jitted.shape[0]
        for k, r in enumerate(self.jitted):
            self.checked(jitted[:, k], rows, f"{self.kinds[0]} {r.label!r}", group_size)
        host = []
        for r in self.host:
            args, kwargs = arguments(r)
            kwargs = {**kwargs, **accepted_columns(r.fn, columns)}
            what = f"{self.kinds[1]} {r.label!r}"
            try:
                value = r.fn(*args, **kwargs)
            except Exception as error:
                row = _first_failing_row(r.fn, args, kwargs, rows)
                at = (
                    where(row, group_size, self.item, self.group)
                    if row is not None
                    else f"a batch of {rows} rows"
                )
                raise RewardError(
                    f"{what} raised {type(error).__name__}: {error} on {at}; the step was not "
                    f"applied. Fix the function (it is given {sorted(kwargs)}; the reader's "
                    f"columns are {sorted(columns)})\n"
                    f"{traceback.format_exc(limit=-3)}"
                ) from error
            host.append(self.checked(value, rows, what, group_size).astype(np.float32))
        j, h = iter(jitted.T), iter(host)
        out = [next(h) if r.host else next(j) for r in self.items]
        return np.stack(out, axis=1).astype(np.float32) if out else np.zeros((rows, 0), np.float32)

    def host_stage(
        self, rollout: Mapping[str, np.ndarray], tokenizer, *, end_ids=(), group_size: int = 1
    ) -> dict[str, np.ndarray]:
        """The host part of a rollout's rewards (``Objective.prepare_host``): the jitted
        values (``rollout['token_rewards']``) checked, each host reward called once over
        the decoded prompts and completions and the reader's columns (keys under
        :data:`READER`); ``{'rewards': [rows, rewards]}`` float32 in :attr:`names` order."""
        token = np.asarray(rollout["token_rewards"], np.float32)
        texts, columns = {}, {}
        if self.host:
            data = {k[len(READER) :]: v for k, v in rollout.items() if k.startswith(READER)}
            columns = text_columns(tokenizer, data)
            texts = dict(
                prompts=decode_rows(tokenizer, rollout["prompt"], rollout["prompt_mask"]),
                completions=decode_rows(
                    tokenizer, rollout["completion"], rollout["completion_mask"], end_ids
                ),
            )
        values = self.host_values(token, lambda r: ((), texts), columns, group_size)
        return {"rewards": values}


def accepted_columns(fn: Callable, columns: Mapping[str, Any]) -> dict[str, Any]:
    """The columns ``fn`` takes: all with ``**kwargs``, else those it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return dict(columns)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(columns)
    named = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in named}


def _first_failing_row(fn, args, kwargs, rows: int) -> int | None:
    """The first row on which ``fn`` alone raises, or None (it fails only on the batch)."""
    for row in range(rows):
        try:
            fn(
                *(a[row : row + 1] for a in args),
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


def image_where(row: int, group_size: int) -> str:
    """``"sample r (condition b of the batch, sample g of its group of G)"``."""
    return where(row, group_size, "sample", "condition")


@dataclasses.dataclass(frozen=True)
class ImageRewards(Rewards):
    """An objective's rewards of images in order, each with its weight (:meth:`of`):
    the same :class:`Reward` objects, given images."""

    item: ClassVar[str] = "sample"
    group: ClassVar[str] = "condition"
    kinds: ClassVar[tuple[str, str]] = ("image reward", "host image reward")

    @property
    def compiled(self) -> tuple[Reward, ...]:
        """The jitted rewards (:attr:`jitted`)."""
        return self.jitted

    def compiled_values(self, samples: jax.Array, batch) -> jax.Array:
        """``[rows, jitted rewards]`` float32 of the samples, traced."""
        return self.jitted_values(
            lambda r: r.fn(pixels_of(samples) if r.pixels else samples, batch),
            samples.shape[0],
            f"samples of shape {tuple(samples.shape)}",
        )

    def host_stage(self, samples, compiled, columns, group_size: int) -> np.ndarray:
        """``[rows, rewards]`` float32 in :attr:`names` order: the jitted values checked,
        each host reward called once on the images (as its ``pixels`` says) and the
        columns it takes."""
        images = {}

        def arguments(r):
            if r.pixels not in images:
                images[r.pixels] = (
                    to_pixels(samples) if r.pixels else np.asarray(samples, np.float32)
                )
            return (images[r.pixels],), {}

        return self.host_values(compiled, arguments, columns, group_size)


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
