"""Recipes: one YAML file that names a whole run, checked before anything runs.

A recipe has these sections (each a frozen, keyword-only dataclass below, read by
jsonargparse, which reads Dew's own dataclasses and type hints without a base class)::

    model:      {name: causal_transformer, config: {...}}      # dew.nn.models registry
    tokenizer:  {kind: bytes | hf | bpe, ...}
    objective:  {name: lm, args: {...}, models: {role: {name, config}}}
    data:       {name: token_windows, args: {...}, batch: 8}
                # or {mixture: [{name, reader, weight, args}, ...], batch: 8}
    optimizer:  {name: adamw, learning_rate: 3e-3, args: {...},
                 schedule: {name: cosine, warmup_steps: 10}, clip_norm: 1.0}
    trainer:    {steps: 100, log_every: 10, eval_every: 0, checkpoint_every: 0,
                 accumulate: 1, ema: null, seed: 0}
    mesh:       {data: null, fsdp: 1, tensor: 1, ...}           # dew.train.MeshSpec
    checkpoints: {keep: 3, use_async: true}
    run_dir:    runs/NAME
    compilation_cache: default | off | PATH

The ``config`` of the model, the ``args`` of the objective, the reader and the
optax optimizer are checked against the real signatures and type hints of the
classes and functions they name (:func:`checked_arguments`): an unknown key names
the nearest valid ones, a wrong type names the key and the type, a missing
required argument names it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import yaml

__all__ = [
    "READERS",
    "SCHEDULES",
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "checked_arguments",
    "flatten",
    "load_recipe",
    "plain",
    "recipe_help",
]


class RecipeError(ValueError):
    """A recipe (or an override, or a run directory) that cannot run; the message
    says which key and what to do. The command exits with the bad-configuration code."""


READERS = {
    "token_windows": "dew.data:TokenWindows",
    "preference_pairs": "dew.data:PreferencePairs",
    "prompts": "dew.data:Prompts",
    "sft": "dew.data:SFTExamples",
    "hf_images": "dew.data:HFImages",
    "videos": "dew.data:Videos",
    "npz_arrays": "dew.cli.readers:NpzArrays",
    "mixture": "dew.cli.readers:MixtureOf",
    "parquet_stream": "dew.data:ParquetStream",
}
# optax schedule names (optax.schedules); "constant" = no schedule
SCHEDULES = ("constant", "cosine", "linear", "warmup_cosine", "warmup_constant")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """A registered model (``dew.nn.models.names()``) and its config, or a
    checkpoint directory (``pretrained``: Hugging Face or Dew, ``Pretrained.load``);
    lora: ``dew.nn.lora.LoRA``'s arguments (rank, alpha, targets) to train adapters."""

    name: str = ""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    pretrained: str | None = None
    lora: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerSection:
    """kind: ``bytes`` (``ByteTokenizer``), ``hf`` (a ``tokenizer.json`` at ``path``)
    or ``bpe`` (a byte-level BPE of ``vocab_size`` trained from ``files`` with the
    ``tokenizers`` library, saved into the run directory)."""

    kind: str = "bytes"
    path: str | None = None
    files: list[str] = dataclasses.field(default_factory=list)
    vocab_size: int = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObjectiveSection:
    """name: a name registered next to its family (``dew.objectives.contract.registry``)
    or ``module:Class``. models: further model roles by the objective's field name
    (JEPA's ``predictor``)."""

    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    models: dict[str, ModelSection] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """name: a short name (``READERS``) or ``module:Class``; batch: the global batch."""

    name: str
    batch: int
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleSection:
    """The learning rate over the steps: ``constant``, ``cosine`` / ``linear``
    decay to ``end_factor * learning_rate`` after ``warmup_steps`` of linear warm-up."""

    name: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    end_factor: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerSection:
    """name: an optax optimizer function (``optax.adamw``, ...), its ``args``
    besides the learning rate; clip_norm: ``optax.clip_by_global_norm`` first."""

    name: str = "adamw"
    learning_rate: float = 1e-3
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    schedule: ScheduleSection = dataclasses.field(default_factory=ScheduleSection)
    clip_norm: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerSection:
    """``Trainer`` and ``Trainer.fit``'s arguments; ema: the decay of a moving
    average of the weights (sets the objective's ``ema``), None = the objective's own;
    ema_use_warmup: cap its decay at ``(1 + u) / (10 + u)`` at update ``u``
    (``EMA(use_warmup=True)``, the families' defaults), so a short run's average
    follows its weights; false = the decay from the first update; update_norm: also
    log each logged step's update norm (``Trainer(update_norm=True)``)."""

    steps: int
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 0
    checkpoint_every: int = 0
    accumulate: int = 1
    max_rejected: int = 10
    update_norm: bool = False
    ema: float | None = None
    ema_warmup_steps: int = 0
    ema_use_warmup: bool = True
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSection:
    """``dew.train.MeshSpec``: axis sizes; ``data: null`` absorbs the rest."""

    data: int | None = None
    expert: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    stage: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointsSection:
    """``dew.train.Checkpoints`` in ``RUN_DIR/checkpoints``."""

    keep: int | None = 3
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: str = "min"
    use_async: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackerSection:
    """``wandb`` or ``mlflow`` (``dew.train.trackers``) and its arguments."""

    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """One run. ``compilation_cache``: ``default`` (JAX's persistent cache in
    ``~/.cache/dew/jax``), ``off`` (which YAML reads as false), or a directory;
    ``DEW_COMPILATION_CACHE`` in the environment wins over it."""

    model: ModelSection
    objective: ObjectiveSection
    data: DataSection
    trainer: TrainerSection
    tokenizer: TokenizerSection = dataclasses.field(default_factory=TokenizerSection)
    optimizer: OptimizerSection = dataclasses.field(default_factory=OptimizerSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    checkpoints: CheckpointsSection = dataclasses.field(default_factory=CheckpointsSection)
    trackers: list[TrackerSection] = dataclasses.field(default_factory=list)
    run_dir: str | None = None
    compilation_cache: str | bool = "default"  # YAML reads a bare `off` as false


def recipe_help() -> str:
    """The recipe's sections, each key with its type and default, for ``--help``
    (read from the section classes above, so it cannot drift from them)."""
    lines = ["recipe sections (key: type = default; no default = required):"]

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            hint = hints[field.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{field.name}.")
                continue
            if field.default is not dataclasses.MISSING:
                default = f" = {field.default!r}"
            elif field.default_factory is not dataclasses.MISSING:
                default = f" = {field.default_factory()!r}"
            else:
                default = ""
            lines.append(f"  {prefix}{field.name}: {_type_name(hint)}{default}")

    walk(Recipe, "")
    return "\n".join(lines)


def _type_name(hint) -> str:
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return repr(hint).replace("typing.", "").replace("dew.cli.recipe.", "")


# ------------------------------------------------------------------ reading


def shorthands(raw: dict) -> dict:
    """``raw`` with ``data: {mixture: [...], batch: N, args: {...}}`` written out as
    ``data: {name: mixture, batch: N, args: {sources: [...], ...}}`` (the form a run
    saves); any other recipe is returned as it is."""
    data = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(data, dict) or "mixture" not in data:
        return raw
    args = data.get("args") or {}
    if "name" in data or (isinstance(args, dict) and "sources" in args):
        raise RecipeError(
            "data.mixture is the short form of data: {name: mixture, args: {sources: [...]}}; "
            "give either data.mixture or data.name (with data.args.sources), not both"
        )
    if not isinstance(args, dict):
        raise RecipeError(f"data.args must be a mapping of the reader's arguments, got {args!r}")
    rest = {key: value for key, value in data.items() if key not in ("mixture", "args")}
    return {
        **raw,
        "data": {"name": "mixture", **rest, "args": {"sources": data["mixture"], **args}},
    }


def load_recipe(path: str) -> dict:
    """The recipe file as a dict (YAML or JSON), short forms written out (:func:`shorthands`)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise RecipeError(f"no recipe file {path!r}") from None
    except yaml.YAMLError as error:
        raise RecipeError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{path} holds a YAML {type(raw).__name__}, not a mapping of sections")
    return shorthands(raw)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` with each ``dotted.key=value`` set (values read as YAML: ``3``,
    ``1e-3``, ``[1, 2]``, ``null``). A key of a section the recipe schema fixes
    must exist there; keys inside ``config`` / ``args`` are checked later
    against the signatures."""
    out = _copy(raw)
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. trainer.steps=10)")
        key, _, text = item.partition("=")
        path = key.strip().lstrip("-").split(".")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        _check_path(path, item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


def _check_path(path: list[str], item: str) -> None:
    """The schema part of an override's key: each name a field of its section."""
    cls: Any = Recipe
    for depth, part in enumerate(path):
        if not dataclasses.is_dataclass(cls):
            return
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            where = ".".join(path[:depth]) or "the recipe"
            raise RecipeError(
                f"override {item!r}: {where} has no key {part!r}{_nearest(part, fields)}"
            )
        hint = typing.get_type_hints(cls)[part]
        cls = hint if dataclasses.is_dataclass(hint) else None


def parse_recipe(raw: Mapping) -> Recipe:
    """The sections checked key by key (unknown ones named with the nearest valid
    ones), then typed by jsonargparse."""
    from jsonargparse import ArgumentParser

    raw = shorthands(dict(raw))
    _check_keys(raw, Recipe, "the recipe")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Recipe, "recipe", instantiate=True)
    try:
        namespace = parser.parse_object({"recipe": dict(raw)})
        return parser.instantiate(namespace).recipe
    except Exception as error:  # jsonargparse's ArgumentError and friends
        raise RecipeError(_short(error)) from None


def _check_keys(raw: Any, cls: type, where: str) -> None:
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{where} must be a mapping of keys, got {raw!r:.80}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if key not in fields:
            raise RecipeError(f"{where} has no key {key!r}{_nearest(key, fields)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            _check_keys(value, hint, f"{_join(where, key)}")
        elif typing.get_origin(hint) is list and value is not None:
            (item,) = typing.get_args(hint)
            if dataclasses.is_dataclass(item):
                for i, entry in enumerate(value):
                    _check_keys(entry, item, f"{_join(where, key)}[{i}]")
    for name, field in fields.items():
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        if required and name not in raw:
            raise RecipeError(f"{where} is missing the required key {name!r}")


def _join(where: str, key: str) -> str:
    return key if where == "the recipe" else f"{where}.{key}"


def _nearest(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    return f"{hint} (valid keys: {', '.join(sorted(valid))})"


def _short(error: Exception) -> str:
    text = str(error).strip()
    return text.replace('Parser key "recipe.', 'key "').replace("recipe.", "")


def flatten(tree, prefix: str = "") -> dict:
    """A nested recipe as ``{dotted.key: value}`` (lists are values)."""
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def set_dotted(raw: dict, key: str, value) -> None:
    """``raw[a][b][c] = value`` for ``key`` ``a.b.c`` (sections made as needed)."""
    node = raw
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# ------------------------------------------------------- signature checking


def resolve(name: str, table: Mapping[str, str], what: str) -> Any:
    """``name`` (a short name of ``table`` or ``module:Class``) as the object it names."""
    path = table.get(name, name)
    if ":" not in path:
        raise RecipeError(
            f"unknown {what} {name!r}{_nearest(name, table).replace('valid keys', 'registered')}"
            f"; or give an import path module:Class"
        )
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise RecipeError(f"{what} {name!r}: cannot import {path} ({error})") from None


def is_dew_module(module: str) -> bool:
    """``dew`` or a module under it (Dew's own code)."""
    return module == "dew" or module.startswith("dew.")


def _check_class_paths(value: Any, where: str) -> None:
    """A nested ``class_path`` names a class of a module already imported (Dew's own,
    or one the objective's or reader's module imports): reading a recipe never imports
    a new module for it, which jsonargparse would do before checking its type."""
    import sys

    if isinstance(value, Mapping):
        path = value.get("class_path")
        if isinstance(path, str):
            module = path.rpartition(".")[0]
            if module and not is_dew_module(module) and module not in sys.modules:
                raise RecipeError(
                    f"{where}.class_path {path!r}: {module} is not imported; a nested "
                    f"class_path names a class of Dew or of a module the objective's or "
                    f"reader's own module imports (a recipe is code: name your module in "
                    f"objective.name or data.name, and import the class there)"
                )
        for key, item in value.items():
            _check_class_paths(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_class_paths(item, f"{where}[{i}]")


def checked_arguments(
    target: Callable | type,
    given: Mapping[str, Any],
    where: str,
    *,
    supplied: Mapping[str, Any] = (),
) -> dict[str, Any]:
    """``given`` checked against ``target``'s signature and type hints (a
    dataclass's fields, else the function's parameters) and instantiated
    (nested dataclasses built): the keyword arguments to call ``target`` with.

    supplied: arguments the command fills in itself (the model, the tokenizer);
      a recipe may not set them. Parameters whose type cannot be read from a
      file (modules, callables) are passed through as given.
    """
    from jsonargparse import ArgumentParser, set_parsing_settings

    # a class_path given where any value is accepted stays data (v5's behaviour)
    set_parsing_settings(instantiate_subclass_spec_in_any=False)
    supplied = dict(supplied)
    params = _parameters(target)
    if not isinstance(given, Mapping):
        raise RecipeError(f"{where} must be a mapping of arguments, got {given!r:.80}")
    _check_class_paths(given, where)
    for key in given:
        if key in supplied:
            raise RecipeError(f"{where}.{key} is set by the command (leave it out of the recipe)")
        if key not in params:
            raise RecipeError(f"{where} has no argument {key!r}{_nearest(key, params)}")
    parser = ArgumentParser(exit_on_error=False)
    loose = {}
    for name, (hint, default) in params.items():
        if name in supplied:
            continue
        if _file_readable(hint):
            kwargs = {"required": True} if default is _REQUIRED else {"default": default}
            try:
                parser.add_argument(f"--{name}", type=hint, **kwargs)
                continue
            except Exception:  # a type jsonargparse does not read: passed as given
                pass
        if name in given:
            loose[name] = given[name]
        elif default is _REQUIRED:
            raise RecipeError(f"{where} is missing the required argument {name!r}")
    for name, value in loose.items():
        _check_loose(target, name, value, where)
    typed = {k: v for k, v in given.items() if k not in loose}
    try:
        namespace = parser.parse_object(typed)
        values = vars(parser.instantiate(namespace))
    except Exception as error:
        text = str(error).strip().replace("the following arguments are required:", "missing:")
        raise RecipeError(f"{where}: {text}") from None
    # jsonargparse prefixes names a Namespace method has (keys, items) with U+200B
    values = {k.lstrip("\u200b"): v for k, v in values.items() if k != "__default_config__"}
    # leave out what the recipe did not set: the target's own default applies
    out = {k: v for k, v in values.items() if k in given or params[k][1] is _REQUIRED}
    return {**out, **loose, **supplied}


_REQUIRED = object()


def _parameters(target) -> dict[str, tuple[Any, Any]]:
    """name -> (type hint, default or _REQUIRED)."""
    import inspect

    if dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(target)
        out = {}
        for field in dataclasses.fields(target):
            if not field.init or field.name in ("parent", "name"):
                continue
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = _REQUIRED
            out[field.name] = (hints.get(field.name, Any), default)
        return out
    try:
        hints = typing.get_type_hints(target)
    except Exception:
        hints = {}
    out = {}
    for name, param in inspect.signature(target).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = _REQUIRED if param.default is param.empty else param.default
        out[name] = (hints.get(name, Any), default)
    return out


def _check_loose(target, name: str, value: Any, where: str) -> None:
    """A value passed as given (its type is not one a file reads whole, or its
    hints do not resolve: optax's ``float | Array | Callable``) still has to be
    one of the plain types in its hint (``float``), when the hint names only
    plain types besides what a file cannot give (arrays, callables)."""
    from jsonargparse import ArgumentParser

    hint = _annotation(target, name)
    options = typing.get_args(hint) if typing.get_origin(hint) in _UNIONS else (hint,)
    plain_types = []
    for option in options:
        origin = typing.get_origin(option) or option
        if option in _PLAIN or origin in (list, dict, tuple, typing.Literal):
            plain_types.append(option)
        elif "Callable" in repr(option) or _module(origin).startswith(("jax", "numpy")):
            continue  # not something a file gives: a number or a list stands for it
        else:
            return  # Any, a class of its own: passed as given, unchecked
    if not plain_types:
        return
    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_argument("--value", type=typing.Union[tuple(plain_types)])  # noqa: UP007
        parser.parse_object({"value": value})
    except Exception:
        kinds = " or ".join(dict.fromkeys(getattr(a, "__name__", repr(a)) for a in plain_types))
        raise RecipeError(f"{where}.{name}: {value!r} is not a {kinds}") from None


_PLAIN = (bool, int, float, complex, str, type(None))


def _module(cls) -> str:
    return getattr(cls, "__module__", "") or ""


_UNIONS = (typing.Union, types.UnionType)


def _annotation(target, name: str) -> Any:
    """One parameter's type hint, resolved on its own (a function whose other
    hints name what its module does not import still has this one); Any when
    it does not resolve."""
    import inspect

    try:
        return typing.get_type_hints(target)[name]
    except Exception:
        pass
    target = target if not isinstance(target, type) else target.__init__
    annotation = inspect.signature(target).parameters[name].annotation
    if annotation is inspect.Parameter.empty:
        return Any
    if isinstance(annotation, str):
        try:
            return eval(annotation, getattr(target, "__globals__", {}))  # noqa: S307
        except Exception:
            return Any
    return annotation


def _file_readable(hint) -> bool:
    """A type a YAML value can stand for (not Any, not a callable or a module)."""
    if hint is Any:
        return False
    text = repr(hint)
    return "Callable" not in text and "Module" not in text and "Array" not in text


# ------------------------------------------------------------------ dumping


def plain(value: Any, *, tag: bool = False) -> Any:
    """``value`` as YAML-ready data: a dataclass as its fields, tagged with
    ``class_path`` / ``init_args`` when ``tag`` (so a reload builds the same class
    where a field takes several: ``FlowSchedule`` vs ``DDPMSchedule``), tuples as
    lists; what a file cannot hold (functions) is left out, so its default applies."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {}
        names = {f.name for f in dataclasses.fields(value)}
        flax = {"parent", "name"} if "parent" in names else set()  # a linen module's own
        for field in dataclasses.fields(value):
            if field.init and field.name not in flax:
                fields[field.name] = plain(getattr(value, field.name), tag=tag)
        fields = {k: v for k, v in fields.items() if v is not _UNREADABLE}
        if tag:
            cls = type(value)
            return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": fields}
        return fields
    if isinstance(value, Mapping):
        out = {str(k): plain(v, tag=tag) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _UNREADABLE}
    if isinstance(value, list | tuple):
        return [plain(v, tag=tag) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return _UNREADABLE


_UNREADABLE = object()
