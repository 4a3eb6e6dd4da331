"""Joint-embedding predictive architecture: I-JEPA (Assran et al., 2023) and
V-JEPA (Bardes et al., 2024).

A context encoder ``f_theta`` reads only the context patches of an image (or
video); a narrow predictor ``g_phi`` predicts, from those tokens and the
target positions, the features a target encoder ``f_xi`` gives the whole
image at each target block (:mod:`dew.objectives.jepa.masks`)::

    h = stop_grad(LayerNorm(f_xi(x)))                 # no affine, over features
    z = g_phi(f_theta(x[context]), context, targets)  # per target block
    loss = mean over blocks, patches, features of smooth_l1(z - h[targets])  (I-JEPA)
                                               or |z - h[targets]|           (V-JEPA)

The target encoder is a declared role, ``Role(name='target', averages='encoder',
ema=..., ...)``: the trainer's moving average of the encoder alone,
``xi <- m xi + (1 - m) theta`` after every optimizer update, with ``m``
linear from 0.996 to 1.0 over the planned updates (facebookresearch/ijepa
``src/train.py``); it starts equal to ``theta`` and the loss reads it as
``variables['target']['params']``.

Batches: ``image`` ``[batch, H, W, C]`` (uint8 pixels are scaled to [-1, 1]
inside, floats pass as they are) or ``video`` ``[batch, F, H, W, C]``; an
optional ``label`` is for probes only. The encoder is a
:class:`dew.nn.backbones.ViT` (or any module with its call signature and
``grid``), the predictor a :class:`dew.nn.backbones.ViTPredictor`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import PIXELS, BatchField
from dew.objectives.contract.objective import EMA, Objective, Role, Step
from dew.objectives.contract.weighted import Weighted
from dew.objectives.jepa.masks import MaskLayout, Masks, MultiBlock

LOSSES = ("smooth_l1", "l1")


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Normalise over the last axis, without scale or bias (I-JEPA's target norm)."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def smooth_l1(d: jax.Array) -> jax.Array:
    """``0.5 d^2`` for ``|d| < 1``, else ``|d| - 0.5`` (torch's ``beta = 1``)."""
    a = jnp.abs(d)
    return jnp.where(a < 1.0, 0.5 * d * d, a - 0.5)


def feature_std(x: jax.Array) -> jax.Array:
    """Per-feature standard deviation over every other axis, averaged over features."""
    flat = x.reshape(-1, x.shape[-1])
    return jnp.mean(jnp.std(flat, axis=0))


def effective_rank(x: jax.Array) -> jax.Array:
    """RankMe (Garrido et al., 2023) of ``x [examples, features]``, centred:
    ``exp(entropy(s / sum(s)))`` of its singular values ``s``; 1 = collapsed to
    a line, ``min(examples, features)`` = all directions equal."""
    x = x - x.mean(0, keepdims=True)
    s = jnp.linalg.svd(x.astype(jnp.float32), compute_uv=False)
    p = s / (jnp.sum(s) + 1e-12) + 1e-12
    return jnp.exp(-jnp.sum(p * jnp.log(p)))


def feature_statistics(targets, predictions, pooled, pooled_normed) -> dict[str, jax.Array]:
    """What the log shows of collapse: ``target_std`` and ``prediction_std``
    (:func:`feature_std`), the ``effective_rank`` of the pooled target features
    and ``pooled_std``, the :func:`feature_std` over images of the mean-pooled
    layer-normed target features: how much the features still depend on the
    image (features that only encode the position keep ``target_std`` and
    lose this)."""
    return {
        "target_std": feature_std(targets),
        "prediction_std": feature_std(predictions),
        "effective_rank": effective_rank(pooled),
        "pooled_std": feature_std(pooled_normed),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollapseAlarm:
    """When the log warns that the features collapse (one line).

    std_fraction: warn when ``pooled_std`` falls below this fraction of its
      first logged value (the run's start); 0 = never.
    min_std: warn when ``pooled_std`` falls below this, whatever it started at
      (the targets are layer-normed, so it is on one scale for every model; a
      run that collapses before its first log line is caught by it); 0 = never.
    rank_fraction: warn when ``effective_rank`` falls below this fraction of
      its first logged value; 0 = never.
    min_rank: warn when ``effective_rank`` falls below this (1 = every image's
      pooled features on one line); 0 = never.
    """

    std_fraction: float = 0.25
    min_std: float = 0.01
    rank_fraction: float = 0.25
    min_rank: float = 1.5

    def __post_init__(self):
        for name in ("std_fraction", "rank_fraction"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(
                    f"CollapseAlarm {name} must be in [0, 1), got {getattr(self, name)}"
                )
        for name in ("min_rank", "min_std"):
            if getattr(self, name) < 0:
                raise ValueError(f"CollapseAlarm {name} must be >= 0, got {getattr(self, name)}")

    def check(self, first: Mapping[str, float], now: Mapping[str, float]) -> str | None:
        """The reasons to warn (one phrase), or None, for logged ``now`` against ``first``."""
        reasons = []
        std, std0 = now.get("pooled_std"), first.get("pooled_std")
        if std is not None and std0 and std < self.std_fraction * std0:
            reasons.append(f"pooled_std {std:.3g} < {self.std_fraction:g} x its first {std0:.3g}")
        elif std is not None and std < self.min_std:
            reasons.append(f"pooled_std {std:.3g} < {self.min_std:g}")
        rank, rank0 = now.get("effective_rank"), first.get("effective_rank")
        if rank is not None and rank0 and rank < self.rank_fraction * rank0:
            reasons.append(
                f"effective_rank {rank:.3g} < {self.rank_fraction:g} x its first {rank0:.3g}"
            )
        elif rank is not None and rank < self.min_rank:
            reasons.append(f"effective_rank {rank:.3g} < {self.min_rank:g}")
        return "; ".join(reasons) or None


def momentum_schedule(start: float, end: float, updates: int):
    """``m(u) = start + (end - start) * min(u / updates, 1)``, the EMA decay at update ``u``."""

    def schedule(u):
        return start + (end - start) * jnp.minimum(jnp.asarray(u, jnp.float32) / updates, 1.0)

    return schedule


@registry.register("jepa")
@dataclasses.dataclass(frozen=True, eq=False)
class JepaObjective(Objective):
    """I-JEPA / V-JEPA: predict target-encoder features of masked blocks.

    encoder: the context encoder, ``encoder(pixels, positions=None) -> [batch,
      K, features]`` with a ``grid`` (:class:`dew.nn.backbones.ViT`); its
      moving average is the target encoder.
    predictor: ``predictor(context, context_positions, target_positions) ->
      [batch, T, features]`` (:class:`dew.nn.backbones.ViTPredictor`).
    planned_updates: optimizer updates over which the momentum goes from
      ``momentum[0]`` to ``momentum[1]`` (the run's total steps).
    momentum: ``(start, end)`` EMA decay of the target encoder (I-JEPA
      ``(0.996, 1.0)``, V-JEPA ``(0.998, 1.0)``).
    masks: the :class:`MultiBlock` block sampler (I-JEPA's defaults).
    loss_type: ``'smooth_l1'`` (I-JEPA) or ``'l1'`` (V-JEPA ``loss_exp=1``).
    alarm: when the training log warns of collapse (:class:`CollapseAlarm`,
      :meth:`log_notes`); None = never.
    input_key: the batch key of the pixels; None = ``'video'`` when the
      encoder takes video (``encoder.grid.is_video``), else ``'image'``.
    """

    encoder: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    predictor: Any
    planned_updates: int
    momentum: tuple[float, float] = (0.996, 1.0)
    masks: MultiBlock = dataclasses.field(default_factory=MultiBlock)
    loss_type: str = "smooth_l1"
    alarm: CollapseAlarm | None = dataclasses.field(default_factory=CollapseAlarm)
    input_key: str | None = None

    headline_metrics = ("target_std", "effective_rank")  # printed on the log line

    def __post_init__(self):
        if self.loss_type not in LOSSES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; use one of {LOSSES}")
        if isinstance(self.planned_updates, bool) or self.planned_updates < 1:
            raise ValueError(
                f"planned_updates must be the run's optimizer updates (>= 1), got "
                f"{self.planned_updates!r}; the momentum reaches {self.momentum[1]} there"
            )
        start, end = self.momentum
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(
                f"momentum must be (start, end) with 0 <= start <= end <= 1, got {self.momentum}"
            )
        grid = getattr(self.encoder, "grid", None)
        if grid is None:
            raise TypeError(
                f"JepaObjective's encoder must describe its patch grid (.grid, as "
                f"dew.nn.backbones.ViT does); got {type(self.encoder).__name__}"
            )
        self.layout  # noqa: B018  (checks the masks against the grid now)

    @functools.cached_property
    def data_key(self) -> str:
        """The batch key of the inputs: ``input_key``, or ``"video"`` / ``"image"``
        from the encoder's grid."""
        if self.input_key is not None:
            return self.input_key
        return "video" if self.encoder.grid.is_video else "image"

    @functools.cached_property
    def layout(self) -> MaskLayout:
        """The masks laid out on the encoder's patch grid."""
        shape = tuple(self.encoder.grid.shape)
        frames, height, width = (1, *shape) if len(shape) == 2 else shape
        return self.masks.layout(frames, height, width)

    @functools.cached_property
    def target_ema(self) -> EMA:
        """The target encoder's decay: role ``target`` averages role ``encoder``."""
        start, end = self.momentum
        return EMA(decay=momentum_schedule(start, end, self.planned_updates))

    @functools.cached_property
    def _first_logged(self) -> dict[str, float]:
        """The feature statistics of the first log line this objective saw (filled
        by :meth:`log_notes`): what the collapse alarm compares against."""
        return {}

    # ------------------------------------------------------------- models
    def roles(self) -> tuple[Role, ...]:
        return (
            Role(name="encoder", module=self.encoder),
            Role(name="predictor", module=self.predictor),
            Role(
                name="target",
                module=self.encoder,
                trained=False,
                averages="encoder",
                ema=self.target_ema,
            ),
        )

    def batch_fields(self):
        """The encoder's input: rows of :attr:`input_shape`, uint8 pixels or floats."""
        grid = self.encoder.grid
        frames = f", {grid.num_frames} frames" if grid.is_video else ""
        note = f"image_size {grid.image_size}, patch_size {grid.patch_size}{frames}"
        return (BatchField(self.data_key, self.input_shape, PIXELS, note=note),)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's pixels, ``(H, W, C)`` or ``(F, H, W, C)``."""
        return tuple(self.encoder.grid.pixel_shape(self.encoder.num_channels))

    def init(self, key, spec=None):
        if spec is not None and self.data_key in spec:
            given = tuple(spec[self.data_key].shape)
            if given != self.input_shape:
                raise ValueError(
                    f"the data declares batch[{self.data_key!r}] rows of {given}, but the "
                    f"encoder reads {self.input_shape}; build the ViT for the data's size"
                )
        k_encoder, k_predictor = jax.random.split(key)
        pixels = jnp.zeros((1, *self.input_shape), jnp.float32)
        encoder = self.encoder.init(k_encoder, pixels)
        features = jax.eval_shape(self.encoder.apply, encoder, pixels).shape[-1]
        context = jnp.zeros((1, self.layout.context_keep, features), jnp.float32)
        context_positions = jnp.zeros((1, self.layout.context_keep), jnp.int32)
        target_positions = jnp.zeros((1, self.layout.target_keep), jnp.int32)
        predictor = self.predictor.init(k_predictor, context, context_positions, target_positions)
        return {"params": {"encoder": encoder["params"], "predictor": predictor["params"]}}

    # --------------------------------------------------------------- loss
    def draw_masks(self, key: jax.Array, batch: int) -> Masks:
        """The masks of a batch of ``batch`` examples (a pure function of ``key``): the
        loss's own masks for a step of that key (row ``i`` from ``split(key, batch)[i]``,
        :meth:`Step.row_keys`)."""
        return self.layout.sample(key, batch)

    def loss(self, variables, batch, step: Step):
        """The loss; ``target_std``, ``prediction_std`` and ``effective_rank`` only on
        the steps the log reads (:meth:`dew.objectives.Step.diagnostic`)."""
        from dew.sampling.features import encode, scale_inputs

        pixels = scale_inputs(batch[self.data_key])
        rows = pixels.shape[0]
        masks = self.layout.sample_rows(step.row_keys(rows))
        n, kt = self.masks.num_targets, self.layout.target_keep
        # without 'target' (outside the trainer) the encoder is its own target
        target = variables.get("target", {"params": variables["params"]["encoder"]})
        target_params = target["params"]
        full = jax.lax.stop_gradient(encode(self.encoder, target_params, pixels))
        normed = jax.lax.stop_gradient(layer_norm(full))  # [batch, patches, features]
        flat = masks.targets.reshape(rows, n * kt)
        h = jnp.take_along_axis(normed, flat[:, :, None], axis=1).reshape(rows, n, kt, -1)
        params = variables["params"]
        context = encode(self.encoder, params["encoder"], pixels, masks.context)  # [batch, K, f]
        # each target block is a predictor row of its own (I-JEPA repeats the context)
        z = self.predictor.apply(
            {"params": params["predictor"]},
            jnp.repeat(context, n, axis=0),
            jnp.repeat(masks.context, n, axis=0),
            masks.targets.reshape(rows * n, kt),
        ).reshape(rows, n, kt, -1)  # [batch, blocks, patches, features]
        d = z - h
        per_element = smooth_l1(d) if self.loss_type == "smooth_l1" else jnp.abs(d)
        weights = jnp.ones((rows,), jnp.float32)
        if "example_mask" in batch:  # padded rows of a last validation batch
            weights = batch["example_mask"].astype(jnp.float32)
        loss = Weighted.mean(per_element, weights[:, None, None, None])
        # feature statistics (an SVD among them): on logged steps only, under one
        # condition, each a mean per row as a plain scalar metric is
        metrics = step.diagnostic(
            feature_statistics, h, z, full.mean(axis=1), normed.mean(axis=1), weight=rows
        )
        return loss, metrics

    def log_notes(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """A one-line warning after a training log line whose feature statistics
        have collapsed (:attr:`alarm`), against the first logged line this
        objective saw (the start of the run; after a resume, the resumed start)."""
        if self.alarm is None or "pooled_std" not in metrics:
            return []
        now = {k: float(metrics[k]) for k in ("pooled_std", "effective_rank") if k in metrics}
        if not self._first_logged:
            self._first_logged.update(now)
        reason = self.alarm.check(self._first_logged, now)
        if reason is None:
            return []
        return [
            f"warning: step {step}: JEPA features are collapsing ({reason}); lower the "
            f"learning rate, raise the momentum or widen the predictor (docs/jepa.md)"
        ]

    def evaluate(self, variables, batch, step: Step):
        """The loss and the feature statistics on a validation batch (masks from the
        evaluation key); the trainer evaluates with the averaged weights, so the
        target encoder reads itself."""
        loss, metrics = self.loss(variables, batch, step)
        return {"loss": loss, **metrics}

    # ------------------------------------------------------- checks, export
    def export(self, variables, *, pooling: str = "mean"):
        """A :class:`dew.sampling.features.FeatureExtractor` of
        ``variables['params']['encoder']``: the target encoder for
        ``pipeline(state)`` (the averaged weights), the context encoder for
        ``state.variables()``."""
        from dew.sampling.features import FeatureExtractor

        return FeatureExtractor(
            encoder=self.encoder,
            params=variables["params"]["encoder"],
            input_shape=self.input_shape,
            pooling=pooling,
        )

    def feature_extractor(self, state, *, encoder: str = "target", pooling: str = "mean"):
        """The ``'target'`` (moving-average) or ``'context'`` encoder of a ``TrainState``."""
        if encoder not in ("target", "context"):
            raise ValueError(f"encoder must be 'target' or 'context', got {encoder!r}")
        return self.export(state.variables(averaged=encoder == "target"), pooling=pooling)

    def probe_hook(self, data, *, encoder: str = "context", method: str = "linear", **options):
        """``fn(info)`` for ``trainer.add_hook(fn, every=N)``: probe accuracy of the
        encoder's pooled features, logged as ``probe_accuracy`` (see :func:`probe`).

        data: a ``dew.data.Dataset`` with labelled batches (``label``): the
          probe fits on ``options.get('train_batches', 4)`` batches of
          ``data.train`` and scores one pass of ``data.val``.
        """

        def probe_accuracy(info):
            extractor = self.feature_extractor(info.state, encoder=encoder)
            accuracy = probe(extractor, data, method=method, key=self.data_key, **options)
            info.log({"probe_accuracy": accuracy}, kind="eval")
            info.print(f"probe ({encoder} encoder, {method}) step {info.step}: {accuracy:.4f}")

        return probe_accuracy


def probe(
    extractor,
    data,
    *,
    method: str = "linear",
    key: str = "image",
    train_batches: int = 4,
    ridge: float = 1e-3,
    k: int = 20,
) -> float:
    """Accuracy of a probe on ``extractor``'s pooled features (one process).

    Fits on the first ``train_batches`` batches of ``data.train`` and scores
    one pass of ``data.val`` (rows with ``example_mask`` 0 are dropped);
    ``method`` is ``'linear'`` (closed-form ridge,
    :func:`dew.sampling.features.linear_probe_accuracy`) or ``'knn'``.
    """
    from dew.data import Partition
    from dew.sampling.features import knn_accuracy, linear_probe_accuracy

    if method not in ("linear", "knn"):
        raise ValueError(f"unknown probe method {method!r}; use 'linear' or 'knn'")
    if data.val is None:
        raise ValueError("a probe needs labelled validation data (Dataset.val is None)")
    whole = Partition(0, 1)

    def collect(batches):
        xs, ys = [], []
        for batch in batches:
            if "label" not in batch:
                raise KeyError(f"a probe needs batch['label']; the batch has keys {sorted(batch)}")
            keep = np.asarray(batch.get("example_mask", np.ones(len(batch["label"]), bool)), bool)
            xs.append(extractor(np.asarray(batch[key])[keep]))
            ys.append(np.asarray(batch["label"])[keep])
        return np.concatenate(xs), np.concatenate(ys)

    stream = data.train(whole)
    train_x, train_y = collect(next(stream) for _ in range(train_batches))
    test_x, test_y = collect(data.val(whole))
    if method == "knn":
        return knn_accuracy(train_x, train_y, test_x, test_y, k=k)
    return linear_probe_accuracy(train_x, train_y, test_x, test_y, ridge=ridge)
