"""The objective contract: what the trainer asks of every kind of training.

An objective initialises the variables, computes the loss, evaluates,
previews samples, names the weights that keep a moving average, and wraps
trained weights into an inference task. Everything it needs is a
constructor argument; nothing is global.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import real_number, whole_number
from dew.objectives.contract.batch import BatchField, check_batch_spec, spec_of
from dew.objectives.contract.weighted import Weighted

Variables = dict[str, Any]
Metrics = dict[str, jax.Array]


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
    include: ``include(path) -> bool`` over '/'-joined parameter paths
      (``"layers/mlp/up/kernel"``); None averages every parameter. Leaves
      not included hold the live values in ``TrainState.averaged``.
    """

    decay: float | Callable[[jax.Array], jax.Array] = 0.999
    use_warmup: bool = False
    warmup_steps: int = 0
    include: Callable[[str], bool] | None = None

    def __post_init__(self):
        if not callable(self.decay):
            object.__setattr__(
                self,
                "decay",
                real_number(
                    self.decay,
                    "decay",
                    low=0.0,
                    high=1.0,
                    high_open=True,
                    what="EMA",
                    meaning="the average's factor per update",
                ),
            )
        if not isinstance(self.use_warmup, bool):
            raise TypeError(f"EMA use_warmup must be True or False, got {self.use_warmup!r}")
        warmup = whole_number(
            self.warmup_steps,
            "warmup_steps",
            low=0,
            what="EMA",
            meaning="updates of the linear ramp; 0 = none",
        )
        object.__setattr__(self, "warmup_steps", warmup)

    def decay_at(self, updates: jax.Array) -> jax.Array:
        """The decay applied at optimizer update number ``updates`` (0-based)."""
        updates = jnp.asarray(updates, jnp.float32)
        decay = self.decay(updates) if callable(self.decay) else jnp.float32(self.decay)
        if self.use_warmup:
            decay = jnp.minimum(decay, warmup_ema_decay(updates, 1.0))
        if self.warmup_steps:
            decay = decay * jnp.minimum(1.0, updates / self.warmup_steps)
        return decay


ROLE_NAMES: dict[str, str] = {
    "policy": "the model an objective trains to produce its outputs: the language model "
    "(LM, DPO, GRPO, PPO, MDLM, BD3-LM), the denoiser (diffusion, Flow-GRPO), the student "
    "(distillation)",
    "value": "a value model or head trained beside the policy (PPO)",
    "reference": "a frozen copy of the policy the loss keeps close to (DPO, GRPO, PPO, "
    "Flow-GRPO): Role(initial_from='policy') when it is the initial policy",
    "encoder": "a trained encoder (JEPA's context encoder)",
    "predictor": "a trained predictor reading the encoder's features (JEPA)",
    "target": "a moving average of a trained role the loss reads (JEPA's target encoder): "
    "Role(averages='encoder')",
    "teacher": "a frozen model whose outputs a student learns (distillation)",
    "text_encoder": "the encoder of a text-conditioned model's prompts (diffusion), frozen "
    "or trained",
    "reward": "a frozen reward model",
}
"""Dew's one vocabulary of role names: every family names its models from it, so a
checkpoint's roles and ``load_model(directory, role=...)`` read the same across
families. An objective of your own may use other names (any identifier)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Role:
    """One model an objective uses, by the part it plays.

    name: the role, from :data:`ROLE_NAMES` (``"policy"``, ``"value"``,
      ``"reference"``, ``"encoder"``, ``"predictor"``, ``"target"``, ``"teacher"``,
      ``"text_encoder"``) for Dew's families; unique within an objective.
    module: the ``flax.linen.Module``.
    trained: True = its parameters are optimized (in ``TrainState.params``);
      False = frozen: kept in ``TrainState.frozen[name]``, checkpointed, never in
      the optimizer state. A frozen role's variables come from the objective's
      ``init`` (given weights through the objective's own argument, e.g.
      ``GRPOObjective(reference=...)`` or a distillation teacher's), or from a
      relation below.
    initial_from: a declared relation: this frozen role starts as the initial
      weights of the named role (a reference policy: ``initial_from="policy"``).
      The trainer fills ``variables[name]`` from that role when ``init`` does not
      return it; under LoRA, when the named role trains adapters, the role is the
      base without adapters, stored once (:mod:`dew.train.adapters`).
    averages: a declared relation: this role is the exponential moving average of
      the named trained role (JEPA's ``target`` of ``encoder``), with ``ema`` as its
      decay schedule (None: the objective's ``ema``). It is never optimized: the
      trainer keeps it in ``TrainState.averaged`` (at the trained role's place) and
      passes it to the loss as ``variables[name]['params']``, without gradient.
    ema: an averaged role's :class:`EMA` (decay, warm-up, ``include`` over the
      trained role's own parameter paths).

    A relation naming a role the objective does not declare, or relations that
    form a cycle, raise ValueError before anything is compiled
    (:func:`check_roles`).

    A checkpoint records each role's registry name and config
    (``dew.nn.models.config_of``) and its relations, so
    ``load_model(directory, role=...)`` rebuilds any of them, averaged roles and
    LoRA bases included.
    """

    name: str
    module: Any
    trained: bool = True
    initial_from: str | None = None
    averages: str | None = None
    ema: EMA | None = None

    def __post_init__(self):
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"a role name must be an identifier, got {self.name!r}")
        if self.initial_from is not None and self.averages is not None:
            raise ValueError(
                f"role {self.name!r} declares initial_from={self.initial_from!r} and "
                f"averages={self.averages!r}; an averaged role starts as the role it averages, "
                f"so declare averages= only"
            )
        for relation in ("initial_from", "averages"):
            value = getattr(self, relation)
            if value is None:
                continue
            if self.trained:
                raise ValueError(
                    f"Role({self.name!r}, {relation}={value!r}) is trained; a role "
                    f"{'initialised from' if relation == 'initial_from' else 'averaging'} "
                    f"another is never optimized: pass trained=False"
                )
            if value == self.name:
                raise ValueError(
                    f"Role({self.name!r}, {relation}={value!r}) names itself; name the "
                    f"trained role it comes from"
                )
        if self.ema is not None and self.averages is None:
            raise ValueError(
                f"Role({self.name!r}, ema=...) is not an averaged role; declare the trained "
                f"role it averages with averages='<role>', or set the objective's ema"
            )
        if self.ema is not None and not isinstance(self.ema, EMA):
            raise TypeError(
                f"Role({self.name!r}).ema must be a dew.objectives.EMA, got "
                f"{type(self.ema).__name__}"
            )


def check_roles(objective) -> tuple[Role, ...]:
    """``objective.roles()``, checked: Role objects with unique names, at least one
    trained, and relations (``initial_from``, ``averages``) that name declared roles
    and form no cycle. Raises TypeError / ValueError naming the role and what to do;
    the trainer calls it before anything is compiled."""
    what = type(objective).__name__
    if getattr(objective, "uses_averaged", False):
        raise ValueError(
            f"{what}.uses_averaged is gone: declare the moving average as a role, "
            f"Role(name='target', module=..., trained=False, averages='<trained role>', "
            f"ema=EMA(...)), and read variables['target']['params'] in the loss"
        )
    roles = tuple(objective.roles())
    seen: dict[str, int] = {}
    for role in roles:
        if not isinstance(role, Role):
            raise TypeError(
                f"{what}.roles() must return dew.objectives.Role objects, got {type(role).__name__}"
            )
        seen[role.name] = seen.get(role.name, 0) + 1
    names = [r.name for r in roles]
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(
            f"{what} declares role name(s) {twice} more than once (roles: {names}); give "
            f"every role its own name"
        )
    if not any(role.trained for role in roles):
        raise ValueError(
            f"{what} declares no trained role (roles: {names}); mark at least one "
            f"Role(trained=True)"
        )
    by_name = {r.name: r for r in roles}
    for role in roles:
        for relation in ("initial_from", "averages"):
            other = getattr(role, relation)
            if other is not None and other not in by_name:
                raise ValueError(
                    f"{what}: Role({role.name!r}, {relation}={other!r}) names a role the "
                    f"objective does not declare (roles: {names}); name one of them"
                )
        if role.averages is not None:
            if not by_name[role.averages].trained:
                raise ValueError(
                    f"{what}: Role({role.name!r}, averages={role.averages!r}) averages a "
                    f"frozen role, which never changes; name a trained role "
                    f"({[r.name for r in roles if r.trained]})"
                )
            if role.ema is None and getattr(objective, "ema", None) is None:
                raise ValueError(
                    f"{what}: Role({role.name!r}, averages={role.averages!r}) has no decay: "
                    f"pass Role(..., ema=EMA(decay=...)) or set the objective's ema"
                )
    for role in roles:  # a chain of initial_from ends at a trained or averaged role
        chain = [role.name]
        current = role
        while current.initial_from is not None:
            current = by_name[current.initial_from]
            if current.name in chain:
                cycle = " -> ".join([*chain[chain.index(current.name) :], current.name])
                raise ValueError(
                    f"{what}: the roles' initial_from relations form a cycle ({cycle}), so "
                    f"none of them has weights to start from; let one of them start from a "
                    f"trained role or from its own weights"
                )
            chain.append(current.name)
    averaged: dict[str, Role] = {}
    for role in roles:
        if role.averages is not None:
            first = averaged.setdefault(role.averages, role)
            if first.ema != role.ema:
                raise ValueError(
                    f"{what}: roles {first.name!r} and {role.name!r} both average "
                    f"{role.averages!r} with different EMAs; the trainer keeps one moving "
                    f"average per trained role: give both the same ema"
                )
    return roles


def initial_source(roles: tuple[Role, ...], name: str) -> Role:
    """The role whose initial weights role ``name`` starts from: ``name`` itself, or
    the end of its ``initial_from`` chain (a trained role, an averaged role's trained
    role, or a frozen role with weights of its own)."""
    by_name = {r.name: r for r in roles}
    role = by_name[name]
    while role.initial_from is not None:
        role = by_name[role.initial_from]
    if role.averages is not None:
        role = by_name[role.averages]
    return role


def nn_unbox(tree):
    import flax.linen as nn

    return nn.unbox(tree)


def check_same_shapes(expected, given, *, what: str) -> None:
    """Raise ValueError naming every path whose presence or shape differs."""
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in _leaves(expected)}
    got = {jax.tree_util.keystr(p): tuple(np.shape(x)) for p, x in _leaves(given)}
    problems = [
        f"{k}: given {got[k]}, module has {v}" for k, v in want.items() if k in got and got[k] != v
    ]
    problems += [f"{k}: missing (module has {v})" for k, v in want.items() if k not in got]
    problems += [f"{k}: not in the module (given {v})" for k, v in got.items() if k not in want]
    if problems:
        shown = "; ".join(problems[:8]) + (
            f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        )
        raise ValueError(
            f"{what}: the weights do not fit the module ({shown}); load weights saved for "
            f"this architecture and config"
        )


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def with_initial_values(boxed, values, *, what: str = "init_params"):
    """A fresh init's parameter tree ``boxed`` with ``values`` at its leaves (the
    logical-axis boxes kept, each value cast to the fresh leaf's dtype): how an
    objective starts from ``init_params`` (a ``Pretrained`` load).

    Under LoRA (a model from ``dew.nn.lora.LoRA.apply``) the fresh tree also holds the
    adapters; ``values`` (the base weights) need not: the adapters missing from
    it keep their fresh initialisation (``B = 0``, so the model starts as the
    base). Any other missing, extra or misshapen path is a ValueError naming it.
    """
    import flax.linen as nn

    from dew.nn.lora import merge, split

    values = nn.unbox(values["params"] if "params" in values else values)
    fresh_base, fresh_adapters = split(boxed)
    given_base, given_adapters = split(values)
    if given_adapters:  # a checkpoint's adapters too: all of them, checked below
        fresh_base, given_base = boxed, values
        fresh_adapters = {}
    check_same_shapes(nn.unbox(fresh_base), given_base, what=what)

    def fill(box, value):
        if isinstance(box, nn.meta.AxisMetadata):
            return box.replace_boxed(jnp.asarray(value, box.unbox().dtype))
        return jnp.asarray(value, box.dtype)

    filled = jax.tree.map(
        fill, fresh_base, given_base, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
    )
    return merge(filled, fresh_adapters) if fresh_adapters else filled


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


class Objective:
    """Base class of every objective. Subclasses set ``model`` (or override
    :meth:`roles`) and implement :meth:`init` and :meth:`loss`; the rest is
    optional.

    Attributes:
      model: the trained ``flax.linen.Module`` of a one-model objective.
      ema: an :class:`EMA` of every trained parameter (``TrainState.averaged``, what
        sampling and evaluation read), or None. A moving average the loss reads is a
        role instead (``Role(name='target', averages='encoder', ema=...)``).
      evaluate_averaged: evaluation, previews and exports use the averaged
        weights when there are any.
      prepared_updates: with :meth:`prepare`, the optimizer updates each prepared batch
        feeds (:class:`Updates`); ignored without it.
      headline_metrics: metric names the trainer prints on each log line after the
        loss (``("reward", "kl")``); every metric is in ``metrics.jsonl`` regardless.
      init_reads_spec: :meth:`init` takes the data's batch spec (``init(key,
        spec=...)``). Dew's families set it; an objective of your own that writes
        ``init(self, key)`` (the seed's form) leaves it False, one that writes
        ``init(self, key, spec=None)`` sets it True, and a subclass of a Dew family
        that overrides ``init`` without ``spec`` sets it back to False. The trainer
        reads the declaration (:meth:`initialize`), never the method's signature.

    The loss's value and metrics may carry weights (:mod:`dew.objectives.contract.weighted`):
    a plain scalar means equal weight per example row.
    """

    model: Any
    ema: EMA | None = None
    evaluate_averaged: bool = True
    prepared_updates: Updates = Updates()
    headline_metrics: tuple[str, ...] = ()
    init_reads_spec: bool = False

    def roles(self) -> tuple[Role, ...]:
        """The models this objective uses, named from :data:`ROLE_NAMES`, with their
        relations (``initial_from``, ``averages``). Default: one trained role,
        ``policy``.

        With one trained role, ``variables['params']`` is its parameter tree;
        with several, ``variables['params'][role]``. A frozen or averaged role's
        variables are ``variables[role]`` (``variables['reference']['params']``,
        ``variables['target']['params']``).
        """
        return (Role(name="policy", module=self.model),)

    @property
    def keeps_average(self) -> bool:
        """The trainer keeps a moving average (``TrainState.averaged``): the
        objective's ``ema``, or a role that averages a trained one."""
        return self.ema is not None or any(r.averages is not None for r in self.roles())

    def init(self, key: jax.Array, spec: Mapping[str, Any] | None = None) -> Variables:
        """``{'params': ..., frozen role name: its variables, ...}``; parameters may be
        ``nn.LogicallyPartitioned`` boxes (the trainer shards and unboxes them).

        spec: the data's batch spec, ``{key: Field(shape per row, dtype)}``
          (``dew.data.Dataset.spec``; None when the data declares none), so shapes
          are stated once, by the data. Read only when :attr:`init_reads_spec` is
          True; the seed's ``init(self, key)`` stays valid (see :meth:`initialize`).
        """
        raise NotImplementedError

    def initialize(self, key: jax.Array, spec: Mapping[str, Any] | None = None) -> Variables:
        """What the trainer calls to initialise the variables for data of batch spec
        ``spec``: ``init(key, spec=spec)`` when :attr:`init_reads_spec` and the data
        declares a spec, else the seed's ``init(key)``. An objective inherits this and
        implements :meth:`init`; the declaration, not the method's signature, says which
        form ``init`` has, so an ``init(self, key)`` written against the seed's contract
        keeps working."""
        if self.init_reads_spec and spec is not None:
            return self.init(key, spec=spec)
        return self.init(key)

    def accumulate_for(self, data_parallel: int) -> int | None:
        """The trainer's accumulation (microbatches per update) when the objective
        sizes its own microbatches from the ``data_parallel`` devices
        (``FlowGRPOObjective(device_rows=...)``); None (the default) = the trainer's own
        ``accumulate`` applies. A number here replaces it: the trainer's
        ``accumulate`` must then be 1 or that number."""
        return None

    def prepare(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """Optional: turn a data batch into a training batch, compiled and without
        gradients, on the pre-update weights (rollouts and their rewards,
        reference log-probs, values and advantages; masks; noise). The trainer
        then runs ``prepared_updates.per_batch`` optimizer updates over its rows. Every
        array's leading dimension is the rows, divisible by ``prepared_updates.minibatches``.
        With :meth:`prepare_host`, this is the first of three parts: compiled
        ``prepare`` -> host ``prepare_host`` -> compiled ``prepare_finish``."""
        raise NotImplementedError

    def prepare_host(self, rollout: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Optional: host Python between :meth:`prepare` and :meth:`prepare_finish`
        (rewards over decoded text, a reward model served elsewhere).

        rollout: :meth:`prepare`'s output as numpy arrays, every row of the global
          batch (gathered from all processes). Returns new arrays with the same
          leading rows axis; the trainer places them on the mesh and passes
          ``{**prepare's output, **these}`` to :meth:`prepare_finish`, compiled.
        Raising (a ``ValueError`` naming the bad row) ends ``fit`` before any
        update of this batch is applied; checkpoints already written stay.
        Must be a pure function of ``rollout``, so a resumed run repeats it."""
        raise NotImplementedError

    def prepare_finish(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """Optional, with :meth:`prepare_host`: the second compiled part of the
        prepare phase (advantages from the host's rewards), on the same
        pre-update weights, without gradients. Returns the training batch.
        Default: the batch as it is."""
        return dict(batch)

    def loss(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step):
        """``(loss, metrics)``: the loss a scalar (a mean, equal weight per row), a
        ``Weighted`` or a tuple of ``Weighted`` terms; metrics scalars, ``Weighted``
        or ``Summed`` (:mod:`dew.objectives.contract.weighted`)."""
        raise NotImplementedError

    def evaluate(self, variables: Variables, batch: Mapping[str, jax.Array], step: Step) -> Metrics:
        """Metrics of one validation batch, as in :meth:`loss`; the trainer adds
        them up over the pass (weights and totals separately) and reduces once."""
        raise NotImplementedError

    def summarize(self, results: Mapping[str, float]) -> dict[str, float]:
        """Add derived numbers to the reduced evaluation results (e.g. perplexity)."""
        return dict(results)

    def log_notes(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Lines the trainer prints after the training log line of ``step`` (on the
        host, from its reduced ``metrics``): warnings such as JEPA's collapse alarm.
        Default: none."""
        return []

    def preview(self, variables: Variables, key: jax.Array) -> Any:
        """A sample to log (text, images, video); None = nothing to show."""
        return None

    def export(self, variables: Variables) -> Any:
        """An inference task (``TextGeneration``, ...) wrapping these variables: a
        live run's, a checkpoint's or a Hugging Face load's."""
        raise NotImplementedError(f"{type(self).__name__} has no inference pipeline")

    def pipeline(self, state) -> Any:
        """``export`` of a ``TrainState``'s variables (the averaged ones when the
        objective evaluates with them)."""
        averaged = self.evaluate_averaged and self.keeps_average
        return self.export(state.variables(averaged=averaged))

    def batch_fields(self) -> tuple[BatchField, ...]:
        """The batch keys this objective reads, with each row's shape and the dtypes it
        takes (:class:`dew.objectives.contract.batch.BatchField`); () = not declared. The
        trainer matches them against ``Dataset.spec`` once, before compiling
        (:func:`dew.objectives.contract.batch.check_batch_spec`)."""
        return ()

    def check_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """Validate one host batch before it is compiled against: its shapes against
        :meth:`batch_fields` (for data that declares no spec), then, in subclasses,
        the values (out-of-vocabulary ids, ties, empty completions)."""
        check_batch_spec(self.batch_fields(), spec_of(batch), what=type(self).__name__)

    @property
    def has_evaluate(self) -> bool:
        return type(self).evaluate is not Objective.evaluate

    @property
    def has_preview(self) -> bool:
        return type(self).preview is not Objective.preview

    @property
    def has_prepare(self) -> bool:
        return type(self).prepare is not Objective.prepare

    @property
    def has_prepare_host(self) -> bool:
        return self.has_prepare and type(self).prepare_host is not Objective.prepare_host
