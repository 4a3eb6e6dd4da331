"""A checked :class:`~dew.cli.recipe.Recipe` as the objects of a run: the
tokenizer, the model, the objective, the dataset, the optax optimizer, the
mesh, the checkpoints and the trackers (Dew's public API only)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from dew.cli.recipe import (
    READERS,
    SCHEDULES,
    ModelSection,
    Recipe,
    RecipeError,
    checked_arguments,
    plain,
    resolve,
)

__all__ = [
    "Built",
    "build",
    "build_model",
    "build_optimizer",
    "build_tokenizer",
    "keep_tokenizer",
]


@dataclasses.dataclass
class Built:
    model: Any
    init_params: Any
    tokenizer: Any
    objective: Any
    data: Any
    optimizer: Any
    learning_rate: Any
    mesh: Any
    resolved: dict  # the recipe with every checked argument filled in


def build_tokenizer(recipe: Recipe, run_dir: str | None):
    from dew.data import ByteTokenizer, HFTokenizer

    section = recipe.tokenizer
    if section.kind == "bytes":
        return ByteTokenizer()
    if section.kind == "hf":
        if not section.path:
            raise RecipeError("tokenizer.kind=hf needs tokenizer.path (a tokenizer.json)")
        return HFTokenizer(section.path)
    if section.kind == "bpe":
        return _trained_bpe(section, run_dir)
    raise RecipeError(
        f"tokenizer.kind {section.kind!r} is not one of 'bytes', 'hf' (a tokenizer.json "
        f"at tokenizer.path), 'bpe' (trained from tokenizer.files)"
    )


def _trained_bpe(section, run_dir: str | None):
    """A byte-level BPE trained from ``section.files`` (``tokenizers``): the run's
    own (``RUN_DIR/tokenizer``) when it has one, so a resumed run reads the same;
    else a new one in a throwaway folder, which the command moves into the run
    (:func:`keep_tokenizer`) only once the whole recipe has passed."""
    from dew.data import HFTokenizer

    if not section.files:
        raise RecipeError("tokenizer.kind=bpe needs tokenizer.files (text files to train it on)")
    missing = [f for f in section.files if not os.path.exists(f)]
    if missing:
        raise RecipeError(f"tokenizer.files: no such file {missing[0]!r}")
    directory = os.path.join(run_dir, "tokenizer") if run_dir else None
    if directory and os.path.exists(os.path.join(directory, "tokenizer.json")):
        return HFTokenizer(directory, add_special_tokens=False)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=section.vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(list(section.files), trainer)
    import atexit
    import shutil
    import tempfile

    # nothing is written into the run before the recipe has passed (a bad name or
    # type further on leaves no run directory behind); gone when the process ends
    folder = tempfile.mkdtemp(prefix="dew-bpe-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    directory = os.path.join(folder, "tokenizer")
    os.makedirs(directory)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    import json

    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return HFTokenizer(directory, add_special_tokens=False)


def keep_tokenizer(recipe: Recipe, tokenizer, run_dir: str) -> None:
    """The BPE :func:`_trained_bpe` trained for a new run, moved from its throwaway
    folder into ``RUN_DIR/tokenizer``; call it once the whole recipe has passed."""
    import shutil

    if recipe.tokenizer.kind != "bpe":
        return
    target = os.path.join(run_dir, "tokenizer")
    source = os.path.dirname(tokenizer.path)
    if os.path.abspath(source) == os.path.abspath(target):
        return  # the run's own, read back
    shutil.move(source, target)
    tokenizer.path = os.path.join(target, "tokenizer.json")  # where fingerprint() reads it


def build_model(section: ModelSection, tokenizer, where: str = "model"):
    """``(module, params or None, resolved config)``: a registered model from its
    config, or a checkpoint directory (``pretrained``) with optional LoRA."""
    from dew.nn import models

    params = None
    if section.pretrained:
        from dew.sampling import Pretrained

        if section.name or section.config:
            raise RecipeError(
                f"{where}: give either pretrained (a checkpoint directory) or name + config"
            )
        try:
            pre = Pretrained.load(section.pretrained)
        except (FileNotFoundError, ValueError) as error:
            raise RecipeError(f"{where}.pretrained: {error}") from None
        module, params = pre.model, pre.params
        # absolute: the saved recipe reloads it from any directory (dew resume)
        resolved = {"pretrained": os.path.abspath(section.pretrained)}
    else:
        if not section.name:
            raise RecipeError(
                f"{where}: give pretrained (a checkpoint directory: {where}.pretrained=DIR) "
                f"or name + config (the registered models: {', '.join(models.names())})"
            )
        if section.name not in models.names():
            raise RecipeError(
                f"unknown model {section.name!r}; the registered models are "
                f"{', '.join(models.names())} (dew.nn.models.names())"
            )
        cls = models.get(section.name)
        config = dict(section.config)
        if "vocab_size" in {f.name for f in dataclasses.fields(cls)} and "vocab_size" not in config:
            config["vocab_size"] = tokenizer.vocab_size
        # a saved config's encoded values ({"__dtype__": ...}) are read by models.build
        encoded = {
            k: v
            for k, v in config.items()
            if isinstance(v, dict) and ({"__dtype__", "__dataclass__"} & set(v))
        }
        plain_config = {k: v for k, v in config.items() if k not in encoded}
        config = {**checked_arguments(cls, plain_config, f"{where}.config"), **encoded}
        try:
            module = models.build(section.name, **config)
        except (TypeError, ValueError) as error:
            raise RecipeError(f"{where}.config: {error}") from None
        resolved = {"name": section.name, "config": plain(models.config_of(module)[1])}
    if section.lora:
        from dew.nn.lora import LoRA

        lora = LoRA(**checked_arguments(LoRA, section.lora, f"{where}.lora"))
        module = lora.apply(module)
        resolved["lora"] = plain(lora)
    return module, params, resolved


def _objective(recipe: Recipe, model, params, tokenizer, resolved_models):
    from dew.objectives import Objective
    from dew.objectives.contract.objective import EMA
    from dew.objectives.contract.registry import OBJECTIVES

    cls = resolve(recipe.objective.name, OBJECTIVES, "objective")
    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise RecipeError(
            f"objective.name {recipe.objective.name!r} names {_kind_of(cls)}, not an "
            f"objective (a subclass of dew.objectives.Objective); use a registered name "
            f"({', '.join(OBJECTIVES)}) or module:Class of an objective"
        )
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    supplied: dict[str, Any] = {fields[0]: model}
    for role, section in recipe.objective.models.items():
        if role not in fields:
            raise RecipeError(
                f"objective.models.{role}: {cls.__name__} has no model field {role!r} "
                f"(its fields: {', '.join(fields)})"
            )
        module, weights, resolved_models[role] = build_model(
            section, tokenizer, f"objective.models.{role}"
        )
        supplied[role] = module
        if weights is not None and f"{role}_params" in fields:
            # a checkpoint's weights for a frozen model (distillation's teacher_params)
            supplied[f"{role}_params"] = weights
    if "tokenizer" in fields:
        supplied["tokenizer"] = tokenizer
    if params is not None and "init_params" in fields:
        supplied["init_params"] = params
    args = dict(recipe.objective.args)
    for key in ("rewards", "reward"):
        if key in args and key in fields:
            specs = args.pop(key)
            rewards = [_reward(s, f"objective.args.{key}") for s in _listed(specs)]
            supplied[key] = rewards if key == "rewards" else rewards[0]
    if recipe.trainer.ema is not None:
        if "ema" not in fields:
            raise RecipeError(f"trainer.ema: {cls.__name__} keeps no moving average")
        supplied["ema"] = EMA(
            decay=recipe.trainer.ema,
            use_warmup=recipe.trainer.ema_use_warmup,
            warmup_steps=recipe.trainer.ema_warmup_steps,
        )
    if "planned_updates" in fields and "planned_updates" not in args:
        args["planned_updates"] = recipe.trainer.steps
    kwargs = checked_arguments(cls, args, "objective.args", supplied=supplied)
    try:
        objective = cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise RecipeError(f"objective {recipe.objective.name!r}: {error}") from None
    shown = {k: plain(v, tag=True) for k, v in kwargs.items() if k not in supplied}
    shown.update(
        {
            k: _reward_record(recipe.objective.args[k])
            for k in ("rewards", "reward")
            if k in recipe.objective.args
        }
    )
    return objective, {k: v for k, v in shown.items() if v is not None}


def _listed(specs):
    return specs if isinstance(specs, list) else [specs]


def _reward_record(specs):
    return specs


def _reward(spec, where):
    """``{fn: module:function, weight: 1.0, kind: text | token | image | host_image,
    name: ''}``: a host reward of decoded text, a jitted one of token ids (the LM
    families), a jitted or host one of uint8 images (Flow-GRPO)."""
    from dew.objectives.cores.rewards import HostImageReward, ImageReward, TextReward, TokenReward

    if isinstance(spec, str):
        spec = {"fn": spec}
    if not isinstance(spec, dict) or "fn" not in spec:
        raise RecipeError(
            f"{where}: a reward is {{fn: module:function, weight, kind}}, got {spec!r}"
        )
    spec = dict(spec)
    kind = spec.pop("kind", "text")
    name = spec.pop("fn")
    fn = resolve(name, {}, "reward function")
    if isinstance(fn, type) or not callable(fn):
        raise RecipeError(
            f"{where}.fn {name!r} names {_kind_of(fn)}, not a reward function (a "
            f"module:function called with the prompts and completions)"
        )
    kinds = {
        "text": TextReward,
        "token": TokenReward,
        "image": ImageReward,
        "host_image": HostImageReward,
    }
    cls = kinds.get(kind)
    if cls is None:
        raise RecipeError(
            f"{where}.kind {kind!r}: use 'text' (host, decoded text), 'token' (jitted, token "
            f"ids), 'image' (jitted, uint8 images) or 'host_image' (host, uint8 images)"
        )
    return cls(**checked_arguments(cls, spec, where, supplied={"fn": fn}))


def _kind_of(value) -> str:
    """What a ``module:Name`` turned out to be, for a message."""
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    if callable(value):
        module, name = getattr(value, "__module__", "?"), getattr(value, "__qualname__", value)
        return f"the function {module}.{name}"
    return f"a {type(value).__name__} value"


def _data(recipe: Recipe, tokenizer):
    cls = resolve(recipe.data.name, READERS, "reader")
    reads = callable(getattr(cls, "load", None))
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type) and reads):
        raise RecipeError(
            f"data.name {recipe.data.name!r} names {_kind_of(cls)}, not a reader (a "
            f"dataclass whose load(batch=) returns a dew.data.Dataset); use a registered "
            f"name ({', '.join(READERS)}) or module:Class of a reader"
        )
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    supplied = {"tokenizer": tokenizer} if "tokenizer" in fields else {}
    kwargs = checked_arguments(cls, recipe.data.args, "data.args", supplied=supplied)
    try:
        data = cls(**kwargs).load(batch=recipe.data.batch)
    except (FileNotFoundError, KeyError, TypeError, ValueError) as error:
        said = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise RecipeError(f"data ({recipe.data.name}): {said}") from None
    shown = {k: plain(v, tag=True) for k, v in kwargs.items() if k not in supplied}
    return data, shown


def build_optimizer(recipe: Recipe):
    """``(optax transformation, learning-rate schedule, resolved section)``."""
    import optax

    section = recipe.optimizer
    fn = getattr(optax, section.name, None)
    if not callable(fn) or section.name.startswith("_"):
        known = [n for n in ("adam", "adamw", "sgd", "lion", "adafactor", "lamb", "rmsprop")]
        raise RecipeError(
            f"unknown optimizer {section.name!r}: not a function of optax (e.g. {', '.join(known)})"
        )
    schedule = _schedule(section, recipe.trainer.steps)
    args = checked_arguments(
        fn, section.args, "optimizer.args", supplied={"learning_rate": schedule}
    )
    optimizer = fn(**args)
    if section.clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(section.clip_norm), optimizer)
    resolved = plain(section)
    if section.schedule.name in DECAYING:
        # explicit in the saved recipe: `dew resume RUN trainer.steps=N` keeps the
        # schedule the run was trained with instead of laying it over N steps
        resolved["schedule"]["decay_steps"] = section.schedule.decay_steps or recipe.trainer.steps
    resolved["args"] = {k: plain(v) for k, v in args.items() if k != "learning_rate"}
    resolved["args"] = {
        k: v for k, v in resolved["args"].items() if v is not None or k in section.args
    }
    return optimizer, schedule, resolved


DECAYING = ("cosine", "linear", "warmup_cosine")  # schedules that read decay_steps


def _schedule(section, steps: int):
    import optax

    s = section.schedule
    lr = section.learning_rate
    if s.name not in SCHEDULES:
        raise RecipeError(
            f"optimizer.schedule.name {s.name!r} is not one of {', '.join(SCHEDULES)}"
        )
    decay = (s.decay_steps or steps) - s.warmup_steps
    over = (
        f"optimizer.schedule.decay_steps={s.decay_steps}"
        if s.decay_steps
        else f"trainer.steps={steps}"
    )
    if s.warmup_steps < 0 or (s.decay_steps is not None and s.decay_steps < 1):
        raise RecipeError(
            f"optimizer.schedule: warmup_steps={s.warmup_steps}, decay_steps="
            f"{s.decay_steps}: counts of steps, warmup_steps >= 0 and decay_steps >= 1"
        )
    if decay < 1 and s.name != "constant":
        raise RecipeError(
            f"optimizer.schedule: warmup_steps={s.warmup_steps} leaves no steps to decay "
            f"over {over}; use fewer warm-up steps (e.g. optimizer.schedule.warmup_steps="
            f"{max(0, (s.decay_steps or steps) // 10)})"
        )
    if s.warmup_steps > steps:
        raise RecipeError(
            f"optimizer.schedule.warmup_steps={s.warmup_steps} is longer than the run "
            f"(trainer.steps={steps}): the learning rate never reaches "
            f"optimizer.learning_rate; use fewer warm-up steps or more trainer.steps"
        )
    if s.name == "constant" and s.warmup_steps == 0:
        return lr
    if s.name in ("constant", "warmup_constant"):
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, s.warmup_steps), optax.constant_schedule(lr)],
            [s.warmup_steps],
        )
    if s.name in ("cosine", "warmup_cosine"):
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, s.warmup_steps, s.warmup_steps + decay, end_value=lr * s.end_factor
        )
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, lr, s.warmup_steps),
            optax.linear_schedule(lr, lr * s.end_factor, decay),
        ],
        [s.warmup_steps],
    )


def build_mesh(recipe: Recipe, *, check: bool = True):
    """The recipe's ``MeshSpec``, checked against the devices present (a mesh that
    needs more says how to emulate devices on a CPU) and against the batch: it splits
    into ``trainer.accumulate`` microbatches over the data-parallel axes (``check``:
    what trains or plans; a run read back to sample or export is not checked)."""
    import math

    import jax

    from dew.train import DEFAULT_RULES, MeshSpec
    from dew.train.mesh import data_parallel_size

    try:
        spec = MeshSpec(**dataclasses.asdict(recipe.mesh))
        if not check:
            return spec
        mesh = spec.make()
    except (TypeError, ValueError) as error:
        fixed = math.prod(v for k, v in dataclasses.asdict(recipe.mesh).items() if v)
        count = jax.device_count()
        hint = ""
        if fixed > count or count % fixed:
            hint = (
                f"; the axes given need {fixed} devices and {count} "
                f"{jax.default_backend().upper()} devices are present: on a CPU, "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={fixed} in the "
                f"environment (set before the command starts) emulates {fixed} devices"
            )
        raise RecipeError(f"mesh: {error}{hint}") from None
    rows, accumulate = recipe.data.batch, recipe.trainer.accumulate
    ways = data_parallel_size(mesh, DEFAULT_RULES)
    if accumulate < 1 or rows < 1 or rows % (accumulate * ways):
        sizes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1) or "one device"
        raise RecipeError(
            f"data.batch={rows} does not split into trainer.accumulate={accumulate} "
            f"microbatches over the {ways} data-parallel devices of the mesh ({sizes}); "
            f"make data.batch a multiple of {max(accumulate, 1) * ways}, or change "
            f"trainer.accumulate or mesh.data / mesh.fsdp / mesh.expert"
        )
    return spec


def check_settings(recipe: Recipe) -> None:
    """The numbers a run cannot train with, refused before anything is built (a
    BPE trained, a step compiled): ``trainer.steps`` < 1, a learning rate that is
    not a finite number >= 0 (a negative one ascends the loss; 0, a warning)."""
    import math

    steps = recipe.trainer.steps
    if steps < 1:
        raise RecipeError(
            f"trainer.steps={steps}: a run trains for at least one step; give the number "
            f"of updates to train for (e.g. trainer.steps=100)"
        )
    rate = recipe.optimizer.learning_rate
    if not (math.isfinite(rate) and rate >= 0):
        raise RecipeError(
            f"optimizer.learning_rate={rate}: the learning rate must be a positive finite "
            f"number (a negative one climbs the loss); e.g. optimizer.learning_rate=3e-4"
        )
    if rate == 0:
        print(
            "dew: warning: optimizer.learning_rate=0.0: the weights will not change (the "
            "run computes losses and metrics only); give a positive rate to train, e.g. "
            "optimizer.learning_rate=3e-4",
            file=sys.stderr,
        )


def check_lengths(recipe: Recipe, objective, data) -> None:
    """The data's rows against what the objective reads (its ``batch_fields``), before
    anything compiles; a mismatch says which key to change. ``objective.args.seq_len``
    is the model's input length for every objective; the data's rows follow from it
    (``token_windows`` rows hold ``data.args.seq_len + 1`` ids: an LM reads
    ``seq_len`` of them as input and predicts the next, a masked or block diffusion
    LM reads all of them, so its ``seq_len`` is ``data.args.seq_len + 1``)."""
    from dew.objectives import check_batch_spec

    if not data.spec:
        return
    try:
        check_batch_spec(objective.batch_fields(), data.spec, what=type(objective).__name__)
    except (KeyError, TypeError, ValueError) as error:
        said = " ".join(str(error).strip("\"'").split())
        given = recipe.objective.args.get("seq_len")
        if given is not None:
            hint = (
                f"objective.args.seq_len={given} is the model's input length (docs/"
                f"command-line.md, 'seq_len'): leave it out and the objective reads the "
                f"length from the data, or change data.args.seq_len to give that length"
            )
        else:
            hint = "change data.args (the reader's row length) or data.name"
        raise RecipeError(f"{said}; {hint}") from None


def build(recipe: Recipe, run_dir: str | None, *, with_data: bool = True) -> Built:
    check_settings(recipe)
    tokenizer = build_tokenizer(recipe, run_dir)
    model, params, resolved_model = build_model(recipe.model, tokenizer)
    extra: dict = {}
    objective, objective_args = _objective(recipe, model, params, tokenizer, extra)
    data, data_args = _data(recipe, tokenizer) if with_data else (None, dict(recipe.data.args))
    if data is not None:
        check_lengths(recipe, objective, data)
    optimizer, schedule, resolved_optimizer = build_optimizer(recipe)
    mesh = build_mesh(recipe, check=with_data)
    resolved = plain(recipe)
    resolved["model"] = resolved_model
    resolved["objective"] = {"name": recipe.objective.name, "args": objective_args}
    if extra:
        resolved["objective"]["models"] = extra
    resolved["data"] = {"name": recipe.data.name, "batch": recipe.data.batch, "args": data_args}
    resolved["optimizer"] = resolved_optimizer
    return Built(
        model=model,
        init_params=params,
        tokenizer=tokenizer,
        objective=objective,
        data=data,
        optimizer=optimizer,
        learning_rate=schedule,
        mesh=mesh,
        resolved=resolved,
    )
