"""``Checkpoints``: the state of a run on disk, on Orbax's ``CheckpointManager``.

One checkpoint is one directory per step::

    <directory>/<step>/state/        the whole TrainState (params, opt_state, key as
                                     key data, step, microstep, updates, averaged,
                                     frozen collections), Orbax StandardSave
    <directory>/<step>/data_iter/    the training iterator's position, one JSON file
                                     per process (Grain's checkpoint handler); only
                                     when the iterator has get_state/set_state
    <directory>/<step>/meta/         JSON: the model's registry name and config, how
                                     the data stream resumes
    <directory>/<step>/commit_success.txt   Orbax's commit marker, written last

A ``fit`` whose directory holds checkpoints continues from the newest usable
one. A checkpoint is unusable when its save never finished (no commit marker,
or an Orbax temporary directory ``<step>.orbax-checkpoint-tmp*`` left by a
kill) or it cannot be read (a truncated or corrupt file); it is renamed to
``<step>.unusable`` (nothing is deleted) with a message saying why, and the
one before it is used. A checkpoint written for another model or optimizer
(an array path or shape differs) is an error, not skipped.

The data stream resumes exactly: an iterator with ``get_state``/``set_state``
(a Grain ``DatasetIterator``, ``dew.data`` readers) is put back where it was;
any other iterator is opened fresh and fast-forwarded past the batches the
run consumed (``step`` batches), which is exact for a deterministic stream.

``load_model(directory)`` rebuilds the model (``dew.nn.models``) and its
weights from the directory alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from dew.train.state import TrainState

COMMIT_MARKER = "commit_success.txt"
ITEMS = ("state", "data_iter", "meta")
FORMAT = 1


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for another model or optimizer than this run's."""


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where and how a run keeps its checkpoints.

    directory: the checkpoint directory (created if missing); a relative path
      is taken from the working directory when the object is built.
    keep: how many of the newest checkpoints to keep; None = all.
    use_async: write in a background thread while training goes on (the
      arrays are copied to host memory before ``save`` returns); False =
      every save blocks until it is on disk.
    """

    directory: str | os.PathLike
    _: dataclasses.KW_ONLY
    keep: int | None = 3
    use_async: bool = True

    def __post_init__(self):
        if self.keep is not None and self.keep < 1:
            raise ValueError(
                f"Checkpoints.keep must be >= 1 checkpoints or None (all), got {self.keep}"
            )
        object.__setattr__(self, "directory", os.path.abspath(os.fspath(self.directory)))

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints in the directory, oldest first."""
        return sorted(
            step for step, path in _step_dirs(self.directory) if _incomplete(path) is None
        )

    def open(self, *, print_fn: Callable[[str], None] = print) -> CheckpointSession:
        """Check the directory can be written and open it for one ``fit``."""
        return CheckpointSession(self, print_fn=print_fn)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restored:
    """A checkpoint read back.

    step: the step it was written at.
    path: its directory.
    state: the TrainState, sharded like the run's.
    data_state: the training iterator's saved position (its ``get_state()``),
      or None when the iterator could not save one.
    meta: the checkpoint's JSON metadata.
    """

    step: int
    path: str
    state: TrainState
    data_state: Any
    meta: dict


class CheckpointSession:
    """One ``fit``'s use of a checkpoint directory: restore the newest usable
    checkpoint, save new ones, wait for them at the end."""

    def __init__(self, spec: Checkpoints, *, print_fn: Callable[[str], None] = print):
        import orbax.checkpoint as ocp

        self.spec = spec
        self.print = print_fn
        self.directory = spec.directory
        check_writable(self.directory, what="checkpoints")
        self._ocp = ocp
        self._manager = None
        self.last_saved: int | None = None

    @property
    def manager(self):
        if self._manager is None:
            ocp = self._ocp
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.spec.keep,
                create=True,
                enable_async_checkpointing=self.spec.use_async,
            )
            with _quiet_orbax():
                self._manager = ocp.CheckpointManager(
                    self.directory, options=options, item_names=ITEMS
                )
        return self._manager

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # --------------------------------------------------------------- restore
    def restore(
        self, abstract: TrainState, shardings: TrainState, *, root_key: jax.Array
    ) -> Restored | None:
        """The newest usable checkpoint, read into ``shardings``; None when
        there is none. Unusable ones are renamed aside with a message.

        root_key: the run's root key; a typed key's implementation wraps the
          saved key data back into a key.
        """
        key_impl = jax.random.key_impl(root_key) if _is_typed_key(root_key) else None
        for step, path in _step_dirs(self.directory):
            why = _incomplete(path)
            if why is None:
                try:
                    with _quiet_orbax():
                        restored = self._read(step, path, abstract, shardings, key_impl)
                except CheckpointMismatchError:
                    raise
                except Exception as error:  # a truncated or corrupt file
                    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    why = f"it cannot be read ({type(error).__name__}: {first[:300]})"
                else:
                    return restored
            self._set_aside(step, path, why)
        return None

    def _read(self, step, path, abstract, shardings, key_impl) -> Restored:
        ocp = self._ocp
        meta = json.loads(_read_text(os.path.join(path, "meta", "metadata")))
        saved_abstract = to_saved(abstract, shardings=shardings)
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(os.path.join(path, "state"))
            check_compatible(saved_abstract, metadata.item_metadata.tree, path, meta)
            tree = checkpointer.restore(os.path.join(path, "state"), saved_abstract)
        state = from_saved(tree, key_impl=key_impl, key_sharding=shardings.key)
        data_state = None
        index, count = jax.process_index(), jax.process_count()
        # Written by Grain's handler, one file per process; a run resumed on
        # another number of processes has none for itself and fast-forwards.
        if os.path.exists(os.path.join(path, "data_iter", f"process_{index}-of-{count}.json")):
            import grain

            position = _Position(None)
            grain.checkpoint.CheckpointHandler().restore(
                pathlib.Path(path, "data_iter"), item=position
            )
            data_state = position.state
        return Restored(step=step, path=path, state=state, data_state=data_state, meta=meta)

    def _set_aside(self, step: int, path: str, why: str) -> None:
        target = os.path.join(self.directory, f"{step}.unusable")
        n = 1
        while os.path.exists(target):
            target = os.path.join(self.directory, f"{step}.unusable-{n}")
            n += 1
        if jax.process_index() == 0:
            os.rename(path, target)
        _sync("dew-checkpoint-set-aside")
        self.print(f"Skipping checkpoint {path}: {why}; kept as {target}, nothing deleted")

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: TrainState, iterator: Iterator, meta: dict) -> None:
        """Start writing a checkpoint of ``state`` and the iterator's position
        at ``step`` (asynchronously unless ``use_async=False``)."""
        ocp = self._ocp
        import grain

        position = iterator_position(iterator)
        meta = {
            **meta,
            "format": FORMAT,
            "step": step,
            "data": "position" if position is not None else "fast-forward",
        }
        items = {"state": ocp.args.StandardSave(to_saved(state)), "meta": ocp.args.JsonSave(meta)}
        if position is not None:
            items["data_iter"] = grain.checkpoint.CheckpointSave(_Position(position))
        with _quiet_orbax():
            self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.last_saved = step

    def wait(self) -> None:
        """Block until every started save is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


# ------------------------------------------------------------------ the tree
def to_saved(state: TrainState, *, shardings: TrainState | None = None) -> dict[str, Any]:
    """The tree Orbax writes: the TrainState's fields, a typed PRNG key as its
    key data (``jax.random.key_data``). With ``shardings``, ``state`` is
    abstract and the result a tree of ``jax.ShapeDtypeStruct`` to restore into."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    if shardings is None:
        if _is_typed_key(fields["key"]):
            fields["key"] = jax.random.key_data(fields["key"])
        return fields
    sharding_of = {f.name: getattr(shardings, f.name) for f in dataclasses.fields(shardings)}
    out = {}
    for name, value in fields.items():
        if name == "key" and _is_typed_key(value):
            data = jax.eval_shape(jax.random.key_data, value)
            out[name] = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding_of[name])
        else:
            out[name] = jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                value,
                sharding_of[name],
            )
    return out


def from_saved(tree: dict[str, Any], *, key_impl: Any, key_sharding: Any) -> TrainState:
    """The TrainState of a tree read back by :func:`to_saved`'s inverse."""
    fields = dict(tree)
    if key_impl is not None:
        fields["key"] = jax.device_put(
            jax.random.wrap_key_data(fields["key"], impl=key_impl), key_sharding
        )
    return TrainState(**fields)


def _is_typed_key(value) -> bool:
    return jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def check_compatible(saved_abstract, saved_metadata, path: str, meta: dict) -> None:
    """Raise :class:`CheckpointMismatchError` naming the first array whose path
    or shape differs between this run and the checkpoint at ``path``."""
    import orbax.checkpoint as ocp

    ours = _flat_shapes(ocp.tree.serialize_tree(saved_abstract))
    theirs = _flat_shapes(saved_metadata)
    hint = (
        "; resume with the model and optimizer that wrote it, or point Checkpoints at "
        "another directory"
    )
    model = meta.get("model") or {}
    if model:
        written = f" (written for model {model.get('name')!r} with config {model.get('config')})"
        hint = written + hint
    # Parameters first: a different model shows as its first parameter, not
    # as its moving average or optimizer state.
    for name, shape in sorted(ours.items(), key=lambda item: not item[0].startswith("params/")):
        if name not in theirs:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match this run: {name!r} (shape {shape}) is not in "
                f"the checkpoint{hint}"
            )
        if tuple(theirs[name]) != tuple(shape):
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match this run: {name!r} has shape "
                f"{tuple(theirs[name])} in the checkpoint and {tuple(shape)} in this run{hint}"
            )
    for name, shape in sorted(theirs.items(), key=lambda item: not item[0].startswith("params/")):
        if name not in ours:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match this run: {name!r} (shape {tuple(shape)}) is "
                f"in the checkpoint but not in this run{hint}"
            )


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
    import orbax.checkpoint as ocp

    flat = ocp.tree.to_flat_dict(tree, sep="/")
    return {name: tuple(leaf.shape) for name, leaf in flat.items() if hasattr(leaf, "shape")}


# -------------------------------------------------------------- data position
def iterator_position(iterator: Iterator) -> Any:
    """The iterator's ``get_state()`` (JSON-serialisable, or bytes), or None
    when it cannot save its position."""
    get_state = getattr(iterator, "get_state", None)
    if get_state is None or not callable(getattr(iterator, "set_state", None)):
        return None
    return get_state()


def resume_position(
    iterator: Iterator, restored: Restored | None, *, print_fn: Callable[[str], None]
) -> Iterator:
    """Put a freshly opened training iterator where the restored run left
    off: ``set_state`` when both sides have a position, else skip the
    ``restored.step`` batches the run consumed (with a one-line warning)."""
    if restored is None or restored.step == 0:
        return iterator
    if restored.data_state is not None and callable(getattr(iterator, "set_state", None)):
        iterator.set_state(restored.data_state)
        return iterator
    reason = (
        "cannot save its position (no get_state/set_state)"
        if iterator_position_supported(iterator) is False
        else "has no saved position in the checkpoint"
    )
    print_fn(
        f"Warning: the training iterator ({type(iterator).__name__}) {reason}; "
        f"skipping the {restored.step} batches steps 0..{restored.step - 1} consumed, "
        f"which resumes a deterministic stream exactly"
    )
    for _ in range(restored.step):
        next(iterator)
    return iterator


def iterator_position_supported(iterator: Iterator) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class _Position:
    """A snapshot of an iterator's position, in the shape Grain's checkpoint
    handler writes (``get_state() -> bytes``) and reads (``set_state(bytes)``).

    The snapshot is taken when ``save`` is called, so a background write
    never sees a later position."""

    def __init__(self, state: Any):
        self.state = state

    def get_state(self) -> bytes:
        if isinstance(self.state, bytes):
            record = {"bytes": self.state.decode()}
        else:
            record = {"state": self.state}
        return json.dumps(record, indent=1).encode()

    def set_state(self, raw: bytes) -> None:
        record = json.loads(raw)
        self.state = record["bytes"].encode() if "bytes" in record else record["state"]

    def start_prefetch(self) -> None:
        pass


# ---------------------------------------------------------------- load_model
def load_model(
    directory: str | os.PathLike, *, step: int | None = None, averaged: bool = False
) -> tuple[Any, Any]:
    """``(model, params)`` rebuilt from a checkpoint directory alone.

    The model comes from the registry name and config stored with the
    checkpoint (``dew.nn.models.build``); params are the newest committed
    checkpoint's (or ``step``'s), on the default device.

    averaged: return the moving-average weights (``TrainState.averaged``)
      instead of the live ones.
    """
    directory = os.path.abspath(os.fspath(directory))
    candidates = [path for s, path in _step_dirs(directory) if step is None or s == step]
    skipped = []
    for path in candidates:
        why = _incomplete(path)
        if why is None:
            if skipped:
                print(f"load_model: skipped {'; '.join(skipped)}")
            return _load_model(path, averaged=averaged)
        skipped.append(f"{path} ({why})")
    found = Checkpoints(directory).steps()
    raise FileNotFoundError(
        f"no committed checkpoint{'' if step is None else f' for step {step}'} in {directory} "
        f"(committed steps: {found}{'; skipped ' + '; '.join(skipped) if skipped else ''}); "
        f"train with Trainer(..., checkpoints=Checkpoints(directory)) first"
    )


def _load_model(path: str, *, averaged: bool) -> tuple[Any, Any]:
    import orbax.checkpoint as ocp

    from dew.nn import models

    meta = json.loads(_read_text(os.path.join(path, "meta", "metadata")))
    if not meta.get("model"):
        raise ValueError(
            f"checkpoint {path} does not record its model ({meta.get('model_note', '')}); "
            f"register the model with @dew.nn.models.register so runs can rebuild it"
        )
    model = models.build(meta["model"]["name"], **meta["model"]["config"])
    field = "averaged" if averaged else "params"
    state_dir = os.path.join(path, "state")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with _quiet_orbax():
        tree = ocp.StandardCheckpointer().metadata(state_dir).item_metadata.tree
        if not tree.get(field):
            raise ValueError(
                f"checkpoint {path} keeps no moving average (its objective had no "
                f"ema); load it with averaged=False"
            )
        target = {
            field: jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree[field]
            )
        }
        restored = ocp.PyTreeCheckpointer().restore(
            state_dir,
            args=ocp.args.PyTreeRestore(
                item=target,
                restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True,
            ),
        )
    return model, restored[field]


# ------------------------------------------------------------------- helpers
_TMP_DIR = re.compile(r"^(\d+)\.orbax-checkpoint-tmp(-\d+)?$")


def _step_dirs(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every step directory, newest first: committed
    ones (``<step>``) and unfinished Orbax writes (``<step>.orbax-checkpoint-tmp*``);
    at equal steps the committed one comes first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if name.isdigit():
            out.append((int(name), 1, path))
        elif match := _TMP_DIR.match(name):
            out.append((int(match.group(1)), 0, path))
    return [(step, path) for step, _, path in sorted(out, reverse=True)]


def _incomplete(path: str) -> str | None:
    """Why the checkpoint at ``path`` is unfinished, or None."""
    if _TMP_DIR.match(os.path.basename(path)):
        return "it is an Orbax temporary directory, so its save never finished"
    if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
        return f"it has no commit marker ({COMMIT_MARKER}), so its save never finished"
    for item in ("state", "meta"):
        if not os.path.isdir(os.path.join(path, item)):
            return f"it has no {item}/ directory"
    return None


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def check_writable(directory: str, *, what: str) -> None:
    """Create ``directory`` and write a probe file, or raise naming the path."""
    probe = os.path.join(directory, f".dew-write-probe-{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as error:
        raise PermissionError(
            f"cannot write {what} to {directory!r} ({type(error).__name__}: {error}); choose a "
            f"directory this process can create and write"
        ) from error


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax logs through absl at INFO/WARNING for routine operations; keep
    stdout to Dew's own lines while it works."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)
