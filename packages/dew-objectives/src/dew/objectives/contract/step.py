"""What one training step and one optimizer update know: :class:`Step` (the step's
index, keys and rows), :class:`Updates` (how many updates a prepared batch feeds) and
:class:`EMA` (which parameters keep a moving average, and how fast)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from dew.nn.keywords import real_number, whole_number
from dew.objectives.contract.weighted import Weighted


@flax.struct.dataclass
class Step:
    """What one attempt of the training step knows about itself.

    index: the step counter (attempts, ``TrainState.step``), an int32 scalar.
    key: this attempt's PRNG key, ``fold_in(fold_in(root, step), microbatch)``:
      every draw of a run is a pure function of the root key, the step and the
      microbatch, so a resumed run repeats the same draws.
    rows, row_key, batch_rows: the index of each row of this microbatch in the
      step's whole batch (row ``r`` of microbatch ``j`` of ``k`` is ``r * k + j``),
      the step's key for per-row draws (microbatch 0's ``key``) and the whole batch's
      row count; :meth:`row_keys` combines them. None (0) outside the trainer.
      In :meth:`Objective.evaluate` ``rows`` is each row's index in the whole
      evaluation set (``row_key`` None), so per-row draws follow the row, not its batch.
    is_logged: whether the log reads this step's metrics: in ``Trainer.fit`` a
      traced bool scalar, True on the steps ``log_every`` divides and on the last
      step (one compiled program serves both); True (a Python bool) everywhere
      else (evaluation, previews, an objective called directly). An objective
      computes an expensive diagnostic (an SVD, feature statistics) only then,
      with :meth:`diagnostic`; the loss must not depend on it.
    """

    index: jax.Array
    key: jax.Array
    is_logged: jax.Array | bool = True
    rows: jax.Array | None = None
    row_key: jax.Array | None = None
    batch_rows: int = flax.struct.field(pytree_node=False, default=0)

    def row_keys(self, count: int | None = None) -> jax.Array:
        """One PRNG key per row of this (micro)batch: row ``i`` of the step's whole
        batch (``rows``, set by the trainer) gets ``split(row_key, batch_rows)[i]``. A
        draw made row by row from these keys (a diffusion time and noise, a JEPA mask)
        is the same whatever the accumulation and the device count, so ``accumulate=k``
        and 8 devices equal one full batch even for a stochastic loss; a draw from
        ``key`` over the microbatch's shape is not (it is the microbatch's own stream).

        At ``accumulate=1`` they are ``jax.random.split(key, rows)``, the usual idiom:
        draw from these keys or from ``key``, not from both. Called outside the trainer
        (``rows`` is None): ``split(key, count)``.
        """
        if self.rows is None or self.row_key is None:
            # outside the trainer, or an evaluation step (its rows index the evaluation
            # set, for draws of their own, and it has no row key): the batch's own split
            if count is None and self.rows is None:
                raise ValueError(
                    "Step.row_keys() needs the row count when the step has no rows "
                    "(outside Trainer.fit): pass row_keys(batch_rows)"
                )
            return jax.random.split(self.key, self.rows.shape[0] if count is None else count)
        if count is not None and self.rows.shape[0] != count:
            raise ValueError(
                f"Step.row_keys({count}) asked for {count} keys but this microbatch has "
                f"{self.rows.shape[0]} rows; ask for the batch's own row count"
            )
        return jax.random.split(self.row_key, self.batch_rows)[self.rows]

    def diagnostic(self, fn: Callable[..., Any], *operands, weight=1.0) -> Any:
        """``fn(*operands)`` (a scalar) as a mean of weight ``weight`` on a logged step,
        and ``Weighted(0, 0)`` on any other, where it is not computed. ``fn`` may
        return a dict of scalars: a dict of ``Weighted`` comes back, all computed
        under one condition (one ``lax.cond`` costs about as much as the statistic
        of a small model: measured ~1% of JEPA's tiny step for three of them).

        Under ``Trainer.fit`` it is ``jax.lax.cond(is_logged, fn, zeros)`` on the
        operands without their gradient; with a Python bool it is a plain call (or
        nothing). A log interval adds its steps' totals and weights and divides
        once, so the interval's value is exactly the logged step's: ``weight``
        only matters between microbatches of one step (pass the rows, as a plain
        scalar metric has, to keep a mean per row).
        """
        weight = jnp.asarray(weight, jnp.float32)
        if isinstance(self.is_logged, bool):
            if not self.is_logged:
                shape = jax.eval_shape(fn, *operands)
                return jax.tree.map(
                    lambda _: Weighted(total=jnp.zeros((), jnp.float32), weight=0 * weight),
                    shape,
                )
            return jax.tree.map(lambda v: Weighted.of(v, weight), fn(*operands))
        operands = jax.lax.stop_gradient(operands)
        shape = jax.eval_shape(fn, *operands)

        def skip(*_):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)

        values = jax.lax.cond(self.is_logged, fn, skip, *operands)
        on = jnp.asarray(self.is_logged, jnp.float32) * weight
        return jax.tree.map(lambda v: Weighted(total=v.astype(jnp.float32) * on, weight=on), values)


def warmup_ema_decay(updates: jax.Array, max_decay: float = 0.9999) -> jax.Array:
    """``min(max_decay, (1 + u) / (10 + u))`` at update ``u``: the average follows the
    weights early and reaches ``max_decay`` after ``~9 / (1 - max_decay)`` updates
    (diffusers ``EMAModel`` / timm warm-up, flow_grpo's ``EMAModuleWrapper``)."""
    u = jnp.asarray(updates, jnp.float32)
    return jnp.minimum(max_decay, (1.0 + u) / (10.0 + u))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EMA:
    """Which parameters keep an exponential moving average, and how fast.

    decay: the averaging factor per optimizer update, or a function of the
      update count returning it (a schedule).
    use_warmup: cap the decay at ``(1 + u) / (10 + u)`` at update ``u``
      (:func:`warmup_ema_decay`): the average follows the weights from the first
      update (about the last ``u / 9`` updates early on) and reaches ``decay`` after
      ``~9 / (1 - decay)`` updates. False = ``decay`` from the first update: the
      average starts at the initial weights and, at 0.99, still holds 74% of them
      after 30 updates. The families' default EMAs (diffusion, MDLM, BD3-LM,
      Flow-GRPO) use it; a JEPA target's momentum does not.
    warmup_steps: ramp the decay linearly from 0 to ``decay`` over this many
      updates so early averages follow the weights; 0 = no ramp.
    include: ``include(path) -> bool`` over '/'-joined parameter paths inside each
      trained role (``"layers/mlp/up/kernel"``, without the role's key); None
      averages every parameter. Leaves not included hold the live values in
      ``TrainState.averaged``.
    """

    decay: float | Callable[[jax.Array], jax.Array] = 0.999
    use_warmup: bool = False
    warmup_steps: int = 0
    include: Callable[[str], bool] | None = None

    def __post_init__(self):  # validation only: the fields stay as given
        if not callable(self.decay):
            real_number(
                self.decay,
                "decay",
                low=0.0,
                high=1.0,
                high_open=True,
                what="EMA",
                meaning="the average's factor per update",
            )
        if not isinstance(self.use_warmup, bool):
            raise TypeError(f"EMA use_warmup must be True or False, got {self.use_warmup!r}")
        whole_number(
            self.warmup_steps,
            "warmup_steps",
            low=0,
            what="EMA",
            meaning="updates of the linear ramp; 0 = none",
        )

    def decay_at(self, updates: jax.Array) -> jax.Array:
        """The decay applied at optimizer update number ``updates`` (0-based)."""
        updates = jnp.asarray(updates, jnp.float32)
        decay = self.decay(updates) if callable(self.decay) else jnp.float32(self.decay)
        if self.use_warmup:
            decay = jnp.minimum(decay, warmup_ema_decay(updates, 1.0))
        if self.warmup_steps:
            decay = decay * jnp.minimum(1.0, updates / self.warmup_steps)
        return decay


@dataclasses.dataclass(frozen=True, kw_only=True)
class Updates:
    """How many optimizer updates one prepared batch feeds.

    epochs: passes over the prepared batch.
    minibatches: equal slices of the prepared batch per pass; each is one
      update (one trainer step, itself split by ``Trainer(accumulate=...)``).
    shuffle: draw a new order of the prepared rows for every epoch (from the
      step key), as PPO does; False = the same contiguous slices every epoch.
    """

    epochs: int = 1
    minibatches: int = 1
    shuffle: bool = True

    def __post_init__(self):
        if self.epochs < 1 or self.minibatches < 1:
            raise ValueError(
                f"Updates needs epochs >= 1 and minibatches >= 1, got epochs={self.epochs}, "
                f"minibatches={self.minibatches}"
            )

    @property
    def per_batch(self) -> int:
        """Optimizer updates (trainer steps) per prepared batch."""
        return self.epochs * self.minibatches
