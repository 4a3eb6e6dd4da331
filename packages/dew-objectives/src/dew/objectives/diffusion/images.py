"""Image and video diffusion: DDPM / iDDPM, v-prediction, EDM and flow matching.

For data ``x0`` (a batch of images or videos, or latents), noise ``eps ~ N(0, I)``
and a time ``t`` drawn from the step key, the schedule
(:mod:`dew.sampling.diffusion.schedules`) mixes ``x_t = alpha(t) x0 + sigma(t) eps`` and
the denoiser regresses its target (:mod:`dew.sampling.diffusion.targets`)::

    loss_i = mean over non-batch dims of (F(x_t, t, c) - target)^2     eps / v / x0 / flow
    loss_i = lambda(sigma) mean of (D(x_t, sigma, c) - x0)^2           EDM (x0 target)

averaged over examples with an optional per-example weight (``batch['weight']``;
``batch['example_mask']`` drops padded rows). The references: DDPM (Ho et al. 2020,
``L_simple``), iDDPM (Nichol & Dhariwal 2021: the cosine schedule and the hybrid
loss ``L_simple + L_vlb`` of a learned variance), v-prediction (Salimans & Ho 2022),
EDM (Karras et al. 2022, ``training/loss.py::EDMLoss``), rectified flow / flow matching
(Liu et al. 2022; Lipman et al. 2022; SD3's logit-normal times, Esser et al. 2024).

**Conditioning** ``c``: ``batch['label'] int32 [batch]`` (the model's ``num_classes``;
``num_classes`` itself is the null class) and/or ``batch['context'] [batch, tokens,
context_features]`` text embeddings (optional ``batch['context_mask'] [batch,
tokens]``). With probability ``cond_dropout`` (10%) per example the condition is
replaced by the null one, so the same network learns the unconditional model that
classifier-free guidance needs (Ho & Salimans 2022): the label by the null class, the
context by ``null_context`` (default all zeros, ``[tokens, features]``; pass the
embedding of the empty prompt to match Stable Diffusion's choice) with its mask all
ones. Label and context of a row drop together.

**Text encoder**, the user's choice (``docs/diffusion.md``): a frozen
:class:`dew.sampling.TextEncoder` (``TextEncoder.load``, any checkpoint Dew's loaders
read) whose contexts come precomputed in ``batch['context']``; or, with
``train_text_encoder=True``, a small encoder trained with the denoiser as a second
trained role ``text_encoder`` (``variables['params'] = {'policy': ..., 'text_encoder':
...}``): batches carry token ids ``batch['text'] int32 [batch, max_length]`` (optional
``context_mask``), the loss encodes them, ``c = E_phi(ids)``
(:func:`dew.sampling.diffusion.text_encoders.encode_tokens`), so the gradient of the diffusion
loss reaches ``phi``; dropout replaces ``E_phi(ids)`` by ``null_context``. The route
lives in :mod:`dew.objectives.cores.conditioning`.

**Learned variance** (``model.learn_sigma``, DDPM schedules only): the model outputs
``2C`` channels, the prediction then iDDPM's ``v`` in ``[-1, 1]``, ``log Sigma = f log
beta_t + (1 - f) log beta~_t``, ``f = (v + 1) / 2``; the loss adds the variational
bound term at ``t`` with the mean's gradient stopped (improved-diffusion
``_vb_terms_bpd``: ``KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t))`` in bits per dimension,
the discretized Gaussian decoder NLL at ``t = 0``), scaled by ``T / 1000``.

Batches: ``image`` ``[batch, H, W, C]`` (``uint8`` pixels are scaled to ``[-1, 1]``
inside; floats, e.g. pre-encoded latents, pass as they are) or ``video``
``[batch, F, H, W, C]``; another key with ``input_key``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import FLOATS, IDS, PIXELS, BatchField
from dew.objectives.contract.objective import EMA, Objective, Step, warmup_ema_decay  # noqa: F401 (public here too)
from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.conditioning import (
    TextConditioning,
    guided_context_mask,
    model_conditions,
)
from dew.sampling.diffusion.pipelines import (
    ClassToImage,
    ClassToVideo,
    sample_grid,
    to_pixels,
)
from dew.sampling.diffusion.samplers import (
    check_target_for,
    make_sampler,
    model_denoiser,
    sample_diffusion,
)
from dew.sampling.diffusion.schedules import DDPMSchedule, Schedule, per_row
from dew.sampling.diffusion.targets import predictions_of, target_of

DEFAULT_TARGETS = {"ddpm": "eps", "flow": "flow", "edm": "x0"}
EVAL_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def default_ema() -> EMA:
    """EMA 0.9999 (DiT, Latte) with the ``(1 + u) / (10 + u)`` warm-up."""
    return EMA(decay=0.9999, use_warmup=True)


def normal_kl(mean1, logvar1, mean2, logvar2):
    """``KL(N(mean1, e^logvar1) || N(mean2, e^logvar2))`` elementwise (nats)."""
    return 0.5 * (
        -1.0
        + logvar2
        - logvar1
        + jnp.exp(logvar1 - logvar2)
        + (mean1 - mean2) ** 2 * jnp.exp(-logvar2)
    )


def discretized_gaussian_log_likelihood(x, means, log_scales):
    """log-likelihood of data ``x`` in ``[-1, 1]`` on 256 bins under ``N(means,
    e^(2 log_scales))`` (improved-diffusion ``losses.py``, tanh approximation of the
    normal CDF)."""

    def cdf(v):
        return 0.5 * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))

    centered = x - means
    inv_std = jnp.exp(-log_scales)
    cdf_plus = cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = jnp.log(jnp.maximum(cdf_plus, 1e-12))
    log_one_minus_cdf_min = jnp.log(jnp.maximum(1.0 - cdf_min, 1e-12))
    log_delta = jnp.log(jnp.maximum(cdf_plus - cdf_min, 1e-12))
    return jnp.where(
        x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_one_minus_cdf_min, log_delta)
    )


def posterior_tables(schedule: DDPMSchedule) -> dict[str, np.ndarray]:
    """Per timestep ``[T]`` float64: ``q(x_{t-1} | x_t, x0) = N(c0 x0 + ct x_t,
    e^log_var)`` (``log_var`` clipped at ``t = 0`` as improved-diffusion) and ``log
    beta_t``."""
    betas = schedule.betas
    abar = np.cumprod(1.0 - betas)
    prev = np.concatenate([[1.0], abar[:-1]])
    var = betas * (1.0 - prev) / (1.0 - abar)
    return {
        "c0": betas * np.sqrt(prev) / (1.0 - abar),
        "ct": (1.0 - prev) * np.sqrt(1.0 - betas) / (1.0 - abar),
        "log_var": np.log(np.concatenate([var[1:2], var[1:]])),
        "log_beta": np.log(betas),
    }


def _mean_rows(x: jax.Array) -> jax.Array:
    """``[batch, ...] -> [batch]``: the mean over every non-batch axis."""
    return jnp.mean(x.reshape(x.shape[0], -1), axis=1)


@registry.register("diffusion")
@dataclasses.dataclass(frozen=True, eq=False)
class DiffusionObjective(TextConditioning, Objective):
    """Diffusion training of a denoiser ``model.apply(vars, x, t, label=, context=)``.

    model: the denoiser (:class:`dew.nn.backbones.DiT`, ``VideoDiT``, or any module
      with that call); read for ``num_classes``, ``context_features``, ``learn_sigma``,
      ``in_channels``, ``sample_shape`` / ``num_frames`` when it has them.
    schedule: :class:`~dew.sampling.DDPMSchedule` (default: linear, T = 1000),
      :class:`~dew.sampling.FlowSchedule` or :class:`~dew.sampling.EDMSchedule`.
    target: ``'eps'``, ``'v'``, ``'x0'`` or ``'flow'``; None = the schedule's usual one
      (eps for DDPM, flow for flow matching, x0 for EDM).
    cond_dropout: probability per example of training on the null condition (CFG);
      0 = never (then guidance is refused).
    null_context: ``[tokens, context_features]`` embedding of the null prompt; None = zeros.
    ema: the moving average of the denoiser (default 0.9999 with warm-up); None = none.
      Sampling, evaluation and export use it.
    input_key: the batch key of the data; None = ``'video'`` for a model with
      ``num_frames`` (``VideoDiT``), else ``'image'``.
    sample_shape: one example's shape ``(H, W, C)`` / ``(F, H, W, C)`` to sample; None
      = from the model (``sample_shape``, ``in_channels``, ``num_frames``).
    clip_denoised: samplers clip ``x0`` to ``[-c, c]`` (improved-diffusion, needed by eps
      on the cosine schedule near ``t = T``); ``'auto'`` = 1.0 for ``image`` / ``video``
      inputs (pixels in [-1, 1]), None (no clip) for any other key (latents).
    guidance: the default classifier-free guidance scale of :meth:`sample` (1 = none).
    eval_times: fractions of the time range at which :meth:`evaluate` reports the loss
      (``loss_t0.1``, ...): timestep ``round(f (T-1))``, flow time ``f``, EDM sigma
      at fraction ``f`` of the rho-spaced range (1 = ``sigma_max``).
    eval_seed: the seed of evaluation's noise: the same noise for every batch of a
      shape and every run, so loss curves of two runs compare.
    loss_bins: the training loss is also reported in this many equal bins of the time
      fraction (the fractions of ``eval_times``: timestep ``t / (T-1)``, flow time,
      EDM's rho-spaced sigma), named ``loss_t0-0.33``, ``loss_t0.33-0.67``,
      ``loss_t0.67-1`` for 3, and printed on the log line (``headline_metrics``); each
      is the weighted mean over the rows whose drawn time fell in the bin (NaN over a
      log interval in which none did). 0 = none.
    text_encoder: the :class:`dew.sampling.TextEncoder` that made ``batch['context']``
      (a frozen checkpoint, ``TextEncoder.load``); :meth:`export` puts it in the
      text-to-image/video pipeline and :meth:`preview` encodes ``preview_prompts``
      with it. None = a text-conditioned model exports no pipeline.
    train_text_encoder: False = ``text_encoder`` is frozen (its ``params`` required);
      True = it is trained with the denoiser (role ``text_encoder``), starting from its
      ``params`` (None = a fresh init of its ``module``); batches then carry token ids
      in ``batch[text_key]`` instead of ``context``, and sampling, previews and the
      exported pipeline encode prompts with the trained (averaged) weights.
    text_key: the batch key of the token ids of a trained text encoder.
    preview_count: samples in a :meth:`preview` grid (labels ``0, 1, ...`` cycled for a
      class-conditional model, ``preview_prompts`` cycled for a text one); 0 = no preview.
    preview_prompts: the prompts a text-conditioned preview draws.
    preview_steps: sampling steps of a preview; None = the sampler's default.
    """

    model: Any
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
    schedule: Schedule = dataclasses.field(default_factory=DDPMSchedule)
    target: str | None = None
    cond_dropout: float = 0.1
    null_context: Any = None
    ema: EMA | None = dataclasses.field(default_factory=default_ema)
    input_key: str | None = None
    sample_shape: tuple[int, ...] | None = None
    clip_denoised: float | str | None = "auto"
    guidance: float = 1.0
    eval_times: tuple[float, ...] = EVAL_FRACTIONS
    eval_seed: int = 0
    loss_bins: int = 3
    text_encoder: Any = None
    train_text_encoder: bool = False
    text_key: str = "text"
    preview_count: int = 8
    preview_prompts: tuple[str, ...] = ()
    preview_steps: int | None = None

    def __post_init__(self):
        check_target_for(self.schedule, self.output_target)
        if not 0.0 <= self.cond_dropout < 1.0:
            raise ValueError(f"cond_dropout must be in [0, 1), got {self.cond_dropout}")
        if self.learn_sigma and self.schedule.family != "ddpm":
            raise ValueError(
                f"a learned variance (model.learn_sigma) is iDDPM's and needs a DDPMSchedule; "
                f"got {type(self.schedule).__name__}: build the model with learn_sigma=False"
            )
        if not all(0.0 <= f <= 1.0 for f in self.eval_times):
            raise ValueError(f"eval_times are fractions in [0, 1], got {self.eval_times}")
        if self.loss_bins < 0:
            raise ValueError(f"loss_bins must be >= 0 (0 = none), got {self.loss_bins}")
        self.check_guidance(self.guidance)
        if self.preview_count < 0:
            raise ValueError(f"preview_count must be >= 0 samples, got {self.preview_count}")
        self.check_text_options()

    @functools.cached_property
    def output_target(self) -> str:
        """What the network predicts: ``target``, or the schedule's default
        (:data:`DEFAULT_TARGETS`)."""
        return DEFAULT_TARGETS[self.schedule.family] if self.target is None else self.target

    @functools.cached_property
    def data_key(self) -> str:
        """The batch key of the samples: ``input_key``, or ``"video"`` for a video
        model and ``"image"`` otherwise."""
        if self.input_key is not None:
            return self.input_key
        return "video" if hasattr(self.model, "num_frames") else "image"

    @functools.cached_property
    def clip_value(self) -> float | None:
        """``clip_denoised`` with ``"auto"`` resolved: 1.0 for images and video (pixels
        in [-1, 1]), None for latents."""
        if self.clip_denoised == "auto":
            return 1.0 if self.data_key in ("image", "video") else None
        return self.clip_denoised

    @functools.cached_property
    def sample_dims(self) -> tuple[int, ...] | None:
        """``sample_shape`` as a tuple of ints (None: from the data's spec)."""
        return None if self.sample_shape is None else tuple(int(s) for s in self.sample_shape)

    @functools.cached_property
    def prompts(self) -> tuple[str, ...]:
        """``preview_prompts`` as a tuple."""
        return tuple(self.preview_prompts)

    @property
    def headline_metrics(self) -> tuple[str, ...]:
        """The training loss by time bin (``loss_bins``), on the printed log line."""
        edges = np.linspace(0.0, 1.0, self.loss_bins + 1)
        return tuple(f"loss_t{lo:.2g}-{hi:.2g}" for lo, hi in zip(edges[:-1], edges[1:]))

    # ------------------------------------------------------------- model facts
    @property
    def num_classes(self) -> int:
        return model_conditions(self.model)[0]

    @property
    def context_features(self) -> int:
        return model_conditions(self.model)[1]

    @property
    def learn_sigma(self) -> bool:
        return bool(getattr(self.model, "learn_sigma", False))

    @property
    def is_video(self) -> bool:
        return self.data_key == "video"

    def batch_fields(self):
        """The data: rows of ``sample_shape``, else channels last with the model's rank and
        ``in_channels`` (``[F,] height, width, in_channels``), else any shape (a model that
        states neither); ``label`` (required by a class-conditional model); an optional
        per-example ``weight``; and the text fields (:meth:`text_fields`). ``check_batch``
        checks what a declaration cannot state: label values, the patch grid."""
        if self.sample_dims is not None:
            shape, note = self.sample_dims, "sample_shape"
        elif hasattr(self.model, "in_channels"):
            dims = ("frames", "height", "width")[0 if self.is_video else 1 :]
            shape = (*dims, int(self.model.in_channels))
            note = f"channels last, the model's in_channels={self.model.in_channels}" + (
                "; images go to DiT, videos to VideoDiT" if self.is_video else ""
            )
        else:
            shape, note = None, ""
        label = BatchField(
            "label",
            (),
            IDS,
            required=bool(self.num_classes),
            note=f"class-conditional, num_classes={self.num_classes}" if self.num_classes else "",
        )
        return (
            BatchField(self.data_key, shape, PIXELS, note=note),
            label,
            BatchField("weight", (), FLOATS, required=False, note="one weight per example"),
            *self.text_fields(),
        )

    def example_shape(self) -> tuple[int, ...]:
        """One example's shape: ``sample_shape``, else the model's."""
        if self.sample_dims is not None:
            return self.sample_dims
        if not hasattr(self.model, "sample_shape") or not hasattr(self.model, "in_channels"):
            raise ValueError(
                f"{type(self.model).__name__} does not say its input size; pass "
                f"DiffusionObjective(sample_shape=(H, W, C)) (or (F, H, W, C))"
            )
        shape = (*self.model.sample_shape, self.model.in_channels)
        if self.is_video:
            shape = (getattr(self.model, "num_frames", None) or 1, *shape)
        return tuple(int(s) for s in shape)

    def check_guidance(self, guidance: float) -> None:
        if guidance != 1.0 and self.cond_dropout == 0.0:
            raise ValueError(
                f"guidance {guidance} needs the unconditional model, which is trained only "
                f"with condition dropout; this objective has cond_dropout=0: train with "
                f"cond_dropout > 0 (e.g. 0.1) or sample with guidance=1.0"
            )
        if guidance != 1.0 and not (self.num_classes or self.context_features):
            raise ValueError(
                f"guidance {guidance} needs a conditioned model (num_classes or "
                f"context_features); this one is unconditional: use guidance=1.0"
            )

    # --------------------------------------------------------------------- init

    def init(self, key, spec=None):
        shape = self.example_shape() if spec is None or self.data_key not in spec else None
        if shape is None:
            shape = tuple(spec[self.data_key].shape)
        tokens = 1
        if spec is not None and "context" in spec:
            tokens = int(spec["context"].shape[0])
        x = jnp.zeros((1, *shape), jnp.float32)
        if not self.train_text_encoder:
            init = self.model.init(key, x, jnp.zeros((1,), jnp.float32), **self._dummy(1, tokens))
            return {"params": {"policy": init["params"]}}
        return self.init_with_text_encoder(key, x)

    def _dummy(self, rows: int, tokens: int) -> dict[str, jax.Array]:
        out = {}
        if self.num_classes:
            out["label"] = jnp.zeros((rows,), jnp.int32)
        if self.context_features:
            out["context"] = jnp.zeros((rows, tokens, self.context_features), jnp.float32)
        return out

    # --------------------------------------------------------------- conditions
    def _null_context(self, context: jax.Array) -> jax.Array:
        if self.null_context is None:
            return jnp.zeros(context.shape[1:], context.dtype)
        return jnp.asarray(self.null_context, context.dtype)

    def conditions(self, batch, drop_key: jax.Array | None) -> dict[str, jax.Array]:
        """The model's ``label`` / ``context`` / ``context_mask`` keywords of a batch,
        with condition dropout when ``drop_key`` is given."""
        out = {}
        rows = batch[self.data_key].shape[0]
        drop = None
        if drop_key is not None and self.cond_dropout > 0:
            if drop_key.shape:  # one key per row: the same draw at any accumulation
                drop = jax.vmap(lambda k: jax.random.bernoulli(k, self.cond_dropout))(drop_key)
            else:
                drop = jax.random.bernoulli(drop_key, self.cond_dropout, (rows,))
        if self.num_classes:
            label = jnp.asarray(batch["label"], jnp.int32)
            out["label"] = label if drop is None else jnp.where(drop, self.num_classes, label)
        if self.context_features:
            context = jnp.asarray(batch["context"], jnp.float32)
            mask = batch.get("context_mask")
            if drop is not None:
                null = jnp.broadcast_to(self._null_context(context), context.shape)
                context = jnp.where(drop[:, None, None], null, context)
                if mask is not None:
                    mask = jnp.where(drop[:, None], True, jnp.asarray(mask, bool))
            out["context"] = context
            if mask is not None:
                out["context_mask"] = jnp.asarray(mask, bool)
        return out

    # --------------------------------------------------------------------- loss
    def _data(self, batch) -> jax.Array:
        x = jnp.asarray(batch[self.data_key])
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x.astype(jnp.float32) / 127.5 - 1.0
        return x.astype(jnp.float32)

    def _row_weights(self, batch, rows: int) -> jax.Array:
        weights = jnp.ones((rows,), jnp.float32)
        if "weight" in batch:
            weights = weights * jnp.asarray(batch["weight"], jnp.float32)
        if "example_mask" in batch:  # padded rows of a last validation batch
            weights = weights * jnp.asarray(batch["example_mask"], jnp.float32)
        return weights

    def per_example_loss(self, params, batch, *, time, noise, drop_key):
        """``(loss [batch], metrics [batch] per name)`` at times ``time [batch]`` and noise
        ``noise`` (shape of the data)."""
        x0 = self._data(batch)
        if self.train_text_encoder:  # c = E_phi(ids), in the graph
            batch = self.with_encoded_text(params, batch)
        alpha, sigma = (per_row(c, x0) for c in self.schedule.coefficients(time))
        x_t = alpha * x0 + sigma * noise
        x_in, model_t = self.schedule.model_input(x_t, time)
        raw = self.model.apply(
            {"params": self.denoiser_params(params)},
            x_in,
            model_t,
            **self.conditions(batch, drop_key),
        )
        raw = raw.astype(jnp.float32)
        variance = None
        if self.learn_sigma:
            raw, variance = jnp.split(raw, 2, axis=-1)
        prediction = self.schedule.network_output(raw, x_t, time)
        if self.schedule.family == "edm":
            mse = _mean_rows((prediction - x0) ** 2)
            loss = self.schedule.loss_weight(time) * mse
        else:
            mse = _mean_rows(
                (prediction - target_of(self.output_target, x0, noise, alpha, sigma)) ** 2
            )
            loss = mse
        metrics = {"mse": mse}
        if variance is not None:
            vb = self._vb_terms(jax.lax.stop_gradient(prediction), variance, x0, x_t, time)
            vb = vb * (self.schedule.num_timesteps / 1000.0)
            loss = loss + vb
            metrics["vb"] = vb
        return loss, metrics

    def _vb_terms(self, prediction, variance, x0, x_t, time):
        """iDDPM's ``L_t`` (bits per dimension) with the mean from a frozen prediction."""
        tables = {
            k: jnp.asarray(v, jnp.float32)[time] for k, v in posterior_tables(self.schedule).items()
        }
        c0, ct, log_var, log_beta = (
            per_row(tables[k], x0) for k in ("c0", "ct", "log_var", "log_beta")
        )
        alpha, sigma = (per_row(c, x0) for c in self.schedule.coefficients(time))
        x0_hat, _ = predictions_of(self.output_target, prediction, x_t, alpha, sigma)
        true_mean = c0 * x0 + ct * x_t
        model_mean = c0 * x0_hat + ct * x_t
        f = (variance + 1.0) / 2.0
        model_log_var = f * log_beta + (1.0 - f) * log_var
        kl = _mean_rows(normal_kl(true_mean, log_var, model_mean, model_log_var)) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var)
        nll = _mean_rows(nll) / math.log(2.0)
        return jnp.where(time == 0, nll, kl)

    def loss(self, variables, batch, step: Step):
        x0 = batch[self.data_key]
        rows = x0.shape[0]
        # per-row draws (Step.row_keys): a row's time, noise and condition dropout are
        # the same whatever the accumulation and the device count
        keys = jax.vmap(lambda k: jax.random.split(k, 3))(step.row_keys(rows))
        k_time, k_noise, k_drop = keys[:, 0], keys[:, 1], keys[:, 2]
        time = jax.vmap(lambda k: self.schedule.sample_time(k, ()))(k_time)
        noise = jax.vmap(lambda k: jax.random.normal(k, x0.shape[1:], jnp.float32))(k_noise)
        loss, metrics = self.per_example_loss(
            variables["params"], batch, time=time, noise=noise, drop_key=k_drop
        )
        weights = self._row_weights(batch, rows)
        return Weighted.mean(loss, weights), {
            **{k: Weighted.mean(v, weights) for k, v in metrics.items()},
            **self._loss_by_time(loss, time, weights),
        }

    def _loss_by_time(self, loss, time, weights) -> dict[str, Weighted]:
        """``loss [batch]`` as weighted means over the rows whose ``time [batch]`` falls
        in each of ``loss_bins`` equal fractions of the time range (edges from
        ``schedule.time_grid``, increasing in the fraction for every schedule)."""
        if not self.loss_bins:
            return {}
        inner = np.linspace(0.0, 1.0, self.loss_bins + 1)[1:-1]
        which = jnp.searchsorted(self.schedule.time_grid(inner), time, side="right")  # [batch]
        return {
            name: Weighted.mean(loss, weights * (which == b))
            for b, name in enumerate(self.headline_metrics)
        }

    def evaluate(self, variables, batch, step: Step):
        """The loss at each of ``eval_times`` (``loss_t0.1``, ...) and their mean
        (``loss``), conditions never dropped, the noise from ``eval_seed`` only: two runs
        (or two checkpoints) see the same noise on the same batch."""
        x0 = batch[self.data_key]
        rows = x0.shape[0]
        weights = self._row_weights(batch, rows)
        grid = self.schedule.time_grid(self.eval_times)
        root = jax.random.key(self.eval_seed)
        out, total = {}, None
        for i, fraction in enumerate(self.eval_times):
            noise = jax.random.normal(jax.random.fold_in(root, i), x0.shape, jnp.float32)
            time = jnp.broadcast_to(grid[i], (rows,))
            loss, _ = self.per_example_loss(
                variables["params"], batch, time=time, noise=noise, drop_key=None
            )
            out[f"loss_t{fraction:g}"] = Weighted.mean(loss, weights)
            total = loss if total is None else total + loss
        out["loss"] = Weighted.mean(total / len(self.eval_times), weights)
        return out

    # ----------------------------------------------------------------- sampling
    def sample(
        self,
        variables,
        key: jax.Array,
        *,
        num: int | None = None,
        label=None,
        context=None,
        context_mask=None,
        prompts=None,
        sampler=None,
        num_steps: int | None = None,
        guidance: float | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> jax.Array:
        """``[num, *shape]`` float32 samples in the data's scale (pixels in ``[-1, 1]``).

        variables: ``{'params': ...}`` (``state.variables(averaged=True)`` for the EMA).
        num: how many; None = one per label / context row.
        label: ``int32 [num]`` (``num_classes`` = unconditional); context
          ``[num, tokens, features]``; needed when the model is conditioned.
        prompts: strings instead of ``context``, encoded by :meth:`text_encoder_of`
          these variables (the trained encoder's weights when it is trained).
        sampler: a name (``'ddpm'``, ``'ddim'``, ``'euler'``, ``'heun'``, ``'edm_heun'``),
          a config (:class:`~dew.sampling.DDIM`, ...) or None = the schedule's default.
        num_steps: replaces the sampler's steps.
        guidance: classifier-free guidance scale; None = ``self.guidance``.
        shape: one example's shape; None = :meth:`example_shape`.

        Checked in Python, then one compiled program per configuration (cached).
        """
        guidance = self.guidance if guidance is None else float(guidance)
        self.check_guidance(guidance)
        sampler = make_sampler(sampler, schedule=self.schedule, num_steps=num_steps)
        if prompts is not None:
            context = self.prompts_context(variables, prompts, context)
        if self.num_classes and label is None:
            raise ValueError(
                f"the model is class-conditional (num_classes={self.num_classes}); pass "
                f"label=int32 [num] (the null class {self.num_classes} samples unconditionally)"
            )
        if self.context_features and context is None:
            raise ValueError(
                f"the model reads text embeddings; pass context=[num, tokens, "
                f"{self.context_features}]"
            )
        rows = [len(a) for a in (label, context) if a is not None]
        num = num if num is not None else (rows[0] if rows else None)
        if num is None or any(r != num for r in rows):
            raise ValueError(f"num={num} must be given and match the label / context rows {rows}")
        if label is not None and not isinstance(label, jax.core.Tracer):
            values = np.asarray(label)
            if values.min(initial=0) < 0 or values.max(initial=0) > self.num_classes:
                raise ValueError(
                    f"labels must be in [0, {self.num_classes}] ({self.num_classes} = the null "
                    f"class), got min {values.min()} max {values.max()}"
                )
        shape = tuple(shape) if shape is not None else self.example_shape()
        fn = self._sampler_fn(sampler, guidance, (num, *shape))
        params = self.denoiser_params(variables["params"])
        return fn(params, key, label, context, context_mask)

    @functools.lru_cache(maxsize=32)  # noqa: B019 - one compiled sampler per configuration
    def _sampler_fn(self, sampler, guidance, shape):
        def run(params, key, label, context, context_mask):
            apply_fn = functools.partial(self.model.apply, {"params": params})
            if context_mask is not None:
                apply_fn = functools.partial(
                    apply_fn, context_mask=guided_context_mask(context_mask, guidance)
                )
            denoise = model_denoiser(
                apply_fn,
                schedule=self.schedule,
                target=self.output_target,
                learn_sigma=self.learn_sigma,
                label=None if label is None else jnp.asarray(label, jnp.int32),
                null_label=self.num_classes,
                context=context,
                null_context=None if context is None else self._null_context(jnp.asarray(context)),
                guidance=guidance,
                clip_denoised=self.clip_value,
            )
            return sample_diffusion(
                denoise, schedule=self.schedule, sampler=sampler, key=key, shape=shape
            )

        return jax.jit(run)

    # ------------------------------------------------------- preview and export
    def preview(self, variables, key: jax.Array):
        """A grid of ``preview_count`` samples (:func:`dew.sampling.sample_grid`): uint8
        ``[rows * H, columns * W, C]``, or ``[F, rows * H, columns * W, C]`` for video; the
        trainer writes it as a PNG (a GIF) into the run directory and to TensorBoard. None
        when there is nothing to show (``preview_count=0``; a text model without
        ``text_encoder`` and ``preview_prompts``; latents, which need a decoder)."""
        count = self.preview_count
        if not count or self.data_key not in ("image", "video"):
            return None
        conditions = {}
        if self.num_classes:
            conditions["label"] = jnp.asarray(np.arange(count) % self.num_classes, jnp.int32)
        if self.context_features:
            if self.text_encoder is None or not self.prompts:
                return None
            prompts = [self.prompts[i % len(self.prompts)] for i in range(count)]
            conditions["prompts"] = prompts
        samples = self.sample(
            variables, key, num=count, num_steps=self.preview_steps, **conditions
        )  # [count, *example shape] in [-1, 1]
        return sample_grid(to_pixels(samples))

    def export(self, variables):
        """The pipeline of these weights, by the model's conditioning: ``TextToVideo`` /
        ``TextToImage`` (with ``text_encoder``), ``ClassToVideo`` / ``ClassToImage``
        (labels, or a count for an unconditional model), carrying the schedule, target,
        guidance and whether the null condition was trained (``cond_dropout > 0``).
        ``objective.inference_task(state)`` passes the EMA weights."""
        fields = dict(
            model=self.model,
            params=self.denoiser_params(variables["params"]),
            schedule=self.schedule,
            target=self.output_target,
            sample_shape=self.example_shape(),
            guidance=self.guidance,
            has_null_condition=self.cond_dropout > 0,
            clip_denoised=self.clip_value,
        )
        if self.context_features:
            return self.text_pipeline(variables, fields)
        return (ClassToVideo if self.is_video else ClassToImage)(**fields)

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """The declared fields (:meth:`batch_fields`), then what they cannot state: the
        height and width on the model's patch grid, label values and the text batch's
        values."""
        super().check_batch(batch)
        x = np.asarray(batch[self.data_key])
        patch = int(getattr(self.model, "patch_size", 1))
        if self.sample_dims is None and hasattr(self.model, "in_channels"):
            height, width = x.shape[-3:-1]
            if height % patch or width % patch:
                raise ValueError(
                    f"batch[{self.data_key!r}] has shape {x.shape}: the model takes a height "
                    f"and width that are multiples of patch_size {patch}; crop or resize (the "
                    f"model is built for {self.example_shape()})"
                )
        if self.num_classes:
            label = np.asarray(batch["label"])
            if label.size and (label.min() < 0 or label.max() >= self.num_classes):
                raise ValueError(
                    f"batch['label'] holds {label.min()}..{label.max()}, the model has "
                    f"num_classes={self.num_classes} (labels 0..{self.num_classes - 1}; "
                    f"{self.num_classes} is the null class): remap the labels or build the model "
                    f"with more classes"
                )
        if self.context_features:
            self.check_text_batch(batch)
