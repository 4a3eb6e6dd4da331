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

**Conditioning** ``c`` (:mod:`dew.objectives.diffusion.conditions`): ``batch['label']``
and/or ``batch['context']`` text embeddings, replaced by the null condition with
probability ``cond_dropout`` (10%) per example, so the same network learns the
unconditional model that classifier-free guidance needs (Ho & Salimans 2022). The
**text encoder**, the user's choice (``docs/diffusion.md``), is frozen (contexts come
precomputed) or trained with the denoiser as a second trained role ``text_encoder``
(``train_text_encoder=True``: batches carry token ids ``batch['text']``), a component
of the conditions (:class:`dew.objectives.cores.conditioning.TextConditioning`).

**Learned variance** (``model.learn_sigma``, DDPM schedules only): the loss adds iDDPM's
variational bound term at ``t``, scaled by ``T / 1000``
(:mod:`dew.objectives.diffusion.learned_variance`).

Batches: ``image`` ``[batch, H, W, C]`` (``uint8`` pixels are scaled to ``[-1, 1]``
inside; floats, e.g. pre-encoded latents, pass as they are) or ``video``
``[batch, F, H, W, C]``; another key with ``input_key``.
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
from dew.objectives.contract.batch import FLOATS, PIXELS, BatchField
from dew.objectives.contract.objective import EMA, Objective, Role, Step, warmup_ema_decay  # noqa: F401 (public here too)
from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.conditioning import (
    TextConditioning,
    guided_context_mask,
    model_conditions,
)
from dew.objectives.diffusion.conditions import ImageConditions, check_guidance
from dew.objectives.diffusion.learned_variance import (  # noqa: F401 (public here too)
    discretized_gaussian_log_likelihood,
    mean_rows,
    normal_kl,
    posterior_tables,
    vb_terms,
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
from dew.sampling.diffusion.targets import target_of

DEFAULT_TARGETS = {"ddpm": "eps", "flow": "flow", "edm": "x0"}
EVAL_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


def default_ema() -> EMA:
    """EMA 0.9999 (DiT, Latte) with the ``(1 + u) / (10 + u)`` warm-up."""
    return EMA(decay=0.9999, use_warmup=True)


def data_key_of(model, input_key: str | None) -> str:
    """The batch key of the samples: ``input_key``, or ``"video"`` for a video model
    (one with ``num_frames``) and ``"image"`` otherwise."""
    if input_key is not None:
        return input_key
    return "video" if hasattr(model, "num_frames") else "image"


def example_shape_of(model, sample_shape, *, is_video: bool) -> tuple[int, ...]:
    """One example's shape: ``sample_shape``, else the model's (``sample_shape``,
    ``in_channels``, ``num_frames`` for video)."""
    if sample_shape is not None:
        return tuple(int(s) for s in sample_shape)
    if not hasattr(model, "sample_shape") or not hasattr(model, "in_channels"):
        raise ValueError(
            f"{type(model).__name__} does not say its input size; pass "
            f"DiffusionObjective(sample_shape=(H, W, C)) (or (F, H, W, C))"
        )
    shape = (*model.sample_shape, model.in_channels)
    if is_video:
        shape = (getattr(model, "num_frames", None) or 1, *shape)
    return tuple(int(s) for s in shape)


def clip_value_of(clip_denoised, data_key: str) -> float | None:
    """``clip_denoised`` with ``"auto"`` resolved: 1.0 for images and video (pixels in
    [-1, 1]), None for latents."""
    if clip_denoised == "auto":
        return 1.0 if data_key in ("image", "video") else None
    return clip_denoised


def learns_sigma(model) -> bool:
    """The model outputs iDDPM's variance too (``learn_sigma``, ``2C`` channels)."""
    return bool(getattr(model, "learn_sigma", False))


def data_of(batch, key: str) -> jax.Array:
    """``batch[key]`` float32: ``uint8`` pixels scaled to ``[-1, 1]``, floats as they are."""
    x = jnp.asarray(batch[key])
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.float32) / 127.5 - 1.0
    return x.astype(jnp.float32)


def row_weights(batch, rows: int) -> jax.Array:
    """``[rows]``: ``batch['weight']`` times ``batch['example_mask']`` (ones without them)."""
    weights = jnp.ones((rows,), jnp.float32)
    if "weight" in batch:
        weights = weights * jnp.asarray(batch["weight"], jnp.float32)
    if "example_mask" in batch:  # padded rows of a last validation batch
        weights = weights * jnp.asarray(batch["example_mask"], jnp.float32)
    return weights


def loss_bin_names(bins: int) -> tuple[str, ...]:
    """``loss_t0-0.33``, ... : the names of ``bins`` equal fractions of the time range."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    return tuple(f"loss_t{lo:.2g}-{hi:.2g}" for lo, hi in zip(edges[:-1], edges[1:]))


def loss_by_time(loss, time, weights, *, schedule: Schedule, bins: int) -> dict[str, Weighted]:
    """``loss [batch]`` as weighted means over the rows whose ``time [batch]`` falls in
    each of ``bins`` equal fractions of the time range (edges from
    ``schedule.time_grid``, increasing in the fraction for every schedule)."""
    if not bins:
        return {}
    inner = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    which = jnp.searchsorted(schedule.time_grid(inner), time, side="right")  # [batch]
    return {
        name: Weighted.mean(loss, weights * (which == b))
        for b, name in enumerate(loss_bin_names(bins))
    }


@functools.lru_cache(maxsize=32)
def compiled_sampler(objective: DiffusionObjective, sampler, guidance: float, shape):
    """The jitted ``run(params, key, label, context, context_mask)`` of one sampling
    configuration of ``objective``: one compiled program each (cached)."""
    conditions = objective.conditions
    learn_sigma = learns_sigma(objective.model)
    clip = clip_value_of(objective.clip_denoised, data_key_of(objective.model, objective.input_key))

    def run(params, key, label, context, context_mask):
        apply_fn = functools.partial(objective.model.apply, {"params": params})
        if context_mask is not None:
            apply_fn = functools.partial(
                apply_fn, context_mask=guided_context_mask(context_mask, guidance)
            )
        denoise = model_denoiser(
            apply_fn,
            schedule=objective.schedule,
            target=objective.output_target,
            learn_sigma=learn_sigma,
            label=None if label is None else jnp.asarray(label, jnp.int32),
            null_label=conditions.num_classes,
            context=context,
            null_context=None if context is None else conditions.null_like(jnp.asarray(context)),
            guidance=guidance,
            clip_denoised=clip,
        )
        return sample_diffusion(
            denoise, schedule=objective.schedule, sampler=sampler, key=key, shape=shape
        )

    return jax.jit(run)


@registry.register("diffusion")
@dataclasses.dataclass(frozen=True, eq=False)
class DiffusionObjective(Objective):
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
        if learns_sigma(self.model) and self.schedule.family != "ddpm":
            raise ValueError(
                f"a learned variance (model.learn_sigma) is iDDPM's and needs a DDPMSchedule; "
                f"got {type(self.schedule).__name__}: build the model with learn_sigma=False"
            )
        if not all(0.0 <= f <= 1.0 for f in self.eval_times):
            raise ValueError(f"eval_times are fractions in [0, 1], got {self.eval_times}")
        if self.loss_bins < 0:
            raise ValueError(f"loss_bins must be >= 0 (0 = none), got {self.loss_bins}")
        num_classes, context_features = model_conditions(self.model)
        check_guidance(
            self.guidance,
            cond_dropout=self.cond_dropout,
            conditioned=bool(num_classes or context_features),
        )
        if self.preview_count < 0:
            raise ValueError(f"preview_count must be >= 0 samples, got {self.preview_count}")
        self.conditions  # noqa: B018  (builds the text route, which checks its options)

    @functools.cached_property
    def output_target(self) -> str:
        """What the network predicts: ``target``, or the schedule's default
        (:data:`DEFAULT_TARGETS`)."""
        return DEFAULT_TARGETS[self.schedule.family] if self.target is None else self.target

    @functools.cached_property
    def conditions(self) -> ImageConditions:
        """The conditions component: called on a batch (and a dropout key, None in
        evaluation) it gives the model's ``label`` / ``context`` / ``context_mask``; it
        holds the text-encoder route (``conditions.text``)."""
        num_classes, context_features = model_conditions(self.model)
        is_video = data_key_of(self.model, self.input_key) == "video"
        text = TextConditioning(
            text_encoder=self.text_encoder,
            train_text_encoder=self.train_text_encoder,
            text_key=self.text_key,
            null_context=self.null_context,
            context_features=context_features,
            is_video=is_video,
        )
        return ImageConditions(
            num_classes=num_classes,
            context_features=context_features,
            cond_dropout=self.cond_dropout,
            null_context=self.null_context,
            text=text,
        )

    @property
    def headline_metrics(self) -> tuple[str, ...]:
        """The training loss by time bin (``loss_bins``), on the printed log line."""
        return loss_bin_names(self.loss_bins)

    def roles(self) -> tuple[Role, ...]:
        """``policy`` (the denoiser); with ``train_text_encoder`` also the trained
        ``text_encoder``."""
        return self.conditions.text.roles(self.model)

    def text_encoder_of(self, variables):
        """The :class:`~dew.sampling.TextEncoder` of these variables: the frozen one, or
        the trained module with ``variables['params']['text_encoder']``."""
        return self.conditions.text.text_encoder_of(variables)

    def batch_fields(self):
        """The data: rows of ``sample_shape``, else channels last with the model's rank and
        ``in_channels`` (``[F,] height, width, in_channels``), else any shape (a model that
        states neither); ``label`` (required by a class-conditional model); an optional
        per-example ``weight``; and the text fields (:meth:`text_fields`). ``check_batch``
        checks what a declaration cannot state: label values, the patch grid."""
        key = data_key_of(self.model, self.input_key)
        if self.sample_shape is not None:
            shape, note = tuple(int(s) for s in self.sample_shape), "sample_shape"
        elif hasattr(self.model, "in_channels"):
            dims = ("frames", "height", "width")[0 if key == "video" else 1 :]
            shape = (*dims, int(self.model.in_channels))
            note = f"channels last, the model's in_channels={self.model.in_channels}" + (
                "; images go to DiT, videos to VideoDiT" if key == "video" else ""
            )
        else:
            shape, note = None, ""
        label, *text = self.conditions.fields()
        return (
            BatchField(key, shape, PIXELS, note=note),
            label,
            BatchField("weight", (), FLOATS, required=False, note="one weight per example"),
            *text,
        )

    # --------------------------------------------------------------------- init

    def init(self, key, spec=None):
        data_key = data_key_of(self.model, self.input_key)
        shape = None
        if spec is None or data_key not in spec:
            shape = example_shape_of(self.model, self.sample_shape, is_video=data_key == "video")
        if shape is None:
            shape = tuple(spec[data_key].shape)
        tokens = 1
        if spec is not None and "context" in spec:
            tokens = int(spec["context"].shape[0])
        x = jnp.zeros((1, *shape), jnp.float32)

        def init_denoiser(k, tokens):
            t = jnp.zeros((1,), jnp.float32)
            return self.model.init(k, x, t, **self.conditions.dummy(1, tokens))

        if not self.train_text_encoder:
            return {"params": {"policy": init_denoiser(key, tokens)["params"]}}
        return self.conditions.text.init_with_text_encoder(key, init_denoiser)

    # --------------------------------------------------------------------- loss
    def per_example_loss(self, params, batch, *, time, noise, drop_key):
        """``(loss [batch], metrics [batch] per name)`` at times ``time [batch]`` and noise
        ``noise`` (shape of the data)."""
        x0 = data_of(batch, data_key_of(self.model, self.input_key))
        text = self.conditions.text
        if self.train_text_encoder:  # c = E_phi(ids), in the graph
            batch = text.with_encoded_text(params, batch)
        alpha, sigma = (per_row(c, x0) for c in self.schedule.coefficients(time))
        x_t = alpha * x0 + sigma * noise
        x_in, model_t = self.schedule.model_input(x_t, time)
        raw = self.model.apply(
            {"params": text.denoiser_params(params)},
            x_in,
            model_t,
            **self.conditions(batch, drop_key),
        )
        raw = raw.astype(jnp.float32)
        variance = None
        if learns_sigma(self.model):
            raw, variance = jnp.split(raw, 2, axis=-1)
        prediction = self.schedule.network_output(raw, x_t, time)
        if self.schedule.family == "edm":
            mse = mean_rows((prediction - x0) ** 2)
            loss = self.schedule.loss_weight(time) * mse
        else:
            mse = mean_rows(
                (prediction - target_of(self.output_target, x0, noise, alpha, sigma)) ** 2
            )
            loss = mse
        metrics = {"mse": mse}
        if variance is not None:
            frozen = jax.lax.stop_gradient(prediction)
            vb = vb_terms(self.schedule, self.output_target, frozen, variance, x0, x_t, time)
            vb = vb * (self.schedule.num_timesteps / 1000.0)
            loss = loss + vb
            metrics["vb"] = vb
        return loss, metrics

    def loss(self, variables, batch, step: Step):
        x0 = batch[data_key_of(self.model, self.input_key)]
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
        weights = row_weights(batch, rows)
        return Weighted.mean(loss, weights), {
            **{k: Weighted.mean(v, weights) for k, v in metrics.items()},
            **loss_by_time(loss, time, weights, schedule=self.schedule, bins=self.loss_bins),
        }

    def evaluate(self, variables, batch, step: Step):
        """The loss at each of ``eval_times`` (``loss_t0.1``, ...) and their mean
        (``loss``), conditions never dropped, the noise from ``eval_seed`` only: two runs
        (or two checkpoints) see the same noise on the same batch."""
        x0 = batch[data_key_of(self.model, self.input_key)]
        rows = x0.shape[0]
        weights = row_weights(batch, rows)
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
        shape: one example's shape; None = the model's (or ``sample_shape``).

        Checked in Python, then one compiled program per configuration (cached).
        """
        num_classes = self.conditions.num_classes
        context_features = self.conditions.context_features
        guidance = self.guidance if guidance is None else float(guidance)
        check_guidance(
            guidance,
            cond_dropout=self.cond_dropout,
            conditioned=bool(num_classes or context_features),
        )
        sampler = make_sampler(sampler, schedule=self.schedule, num_steps=num_steps)
        if prompts is not None:
            context = self.conditions.text.prompts_context(variables, prompts, context)
        if num_classes and label is None:
            raise ValueError(
                f"the model is class-conditional (num_classes={num_classes}); pass "
                f"label=int32 [num] (the null class {num_classes} samples unconditionally)"
            )
        if context_features and context is None:
            raise ValueError(
                f"the model reads text embeddings; pass context=[num, tokens, {context_features}]"
            )
        rows = [len(a) for a in (label, context) if a is not None]
        num = num if num is not None else (rows[0] if rows else None)
        if num is None or any(r != num for r in rows):
            raise ValueError(f"num={num} must be given and match the label / context rows {rows}")
        if label is not None and not isinstance(label, jax.core.Tracer):
            values = np.asarray(label)
            if values.min(initial=0) < 0 or values.max(initial=0) > num_classes:
                raise ValueError(
                    f"labels must be in [0, {num_classes}] ({num_classes} = the null "
                    f"class), got min {values.min()} max {values.max()}"
                )
        if shape is None:
            video = self.conditions.text.is_video
            shape = example_shape_of(self.model, self.sample_shape, is_video=video)
        fn = compiled_sampler(self, sampler, guidance, (num, *tuple(shape)))
        params = self.conditions.text.denoiser_params(variables["params"])
        return fn(params, key, label, context, context_mask)

    # ------------------------------------------------------- preview and export
    def preview(self, variables, key: jax.Array):
        """A grid of ``preview_count`` samples (:func:`dew.sampling.sample_grid`): uint8
        ``[rows * H, columns * W, C]``, or ``[F, rows * H, columns * W, C]`` for video; the
        trainer writes it as a PNG (a GIF) into the run directory and to TensorBoard. None
        when there is nothing to show (``preview_count=0``; a text model without
        ``text_encoder`` and ``preview_prompts``; latents, which need a decoder)."""
        count = self.preview_count
        if not count or data_key_of(self.model, self.input_key) not in ("image", "video"):
            return None
        conditions = {}
        if self.conditions.num_classes:
            labels = np.arange(count) % self.conditions.num_classes
            conditions["label"] = jnp.asarray(labels, jnp.int32)
        if self.conditions.context_features:
            prompts = tuple(self.preview_prompts)
            if self.text_encoder is None or not prompts:
                return None
            conditions["prompts"] = [prompts[i % len(prompts)] for i in range(count)]
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
        text = self.conditions.text
        data_key = data_key_of(self.model, self.input_key)
        fields = dict(
            model=self.model,
            params=text.denoiser_params(variables["params"]),
            schedule=self.schedule,
            target=self.output_target,
            sample_shape=example_shape_of(self.model, self.sample_shape, is_video=text.is_video),
            guidance=self.guidance,
            has_null_condition=self.cond_dropout > 0,
            clip_denoised=clip_value_of(self.clip_denoised, data_key),
        )
        if self.conditions.context_features:
            return text.text_pipeline(variables, fields)
        return (ClassToVideo if text.is_video else ClassToImage)(**fields)

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """The declared fields (:meth:`batch_fields`), then what they cannot state: the
        height and width on the model's patch grid, label values and the text batch's
        values."""
        super().check_batch(batch)
        data_key = data_key_of(self.model, self.input_key)
        x = np.asarray(batch[data_key])
        patch = int(getattr(self.model, "patch_size", 1))
        if self.sample_shape is None and hasattr(self.model, "in_channels"):
            height, width = x.shape[-3:-1]
            if height % patch or width % patch:
                shape = example_shape_of(self.model, None, is_video=data_key == "video")
                raise ValueError(
                    f"batch[{data_key!r}] has shape {x.shape}: the model takes a height "
                    f"and width that are multiples of patch_size {patch}; crop or resize (the "
                    f"model is built for {shape})"
                )
        self.conditions.check_batch(batch)
