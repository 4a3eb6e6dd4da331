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
    <directory>/<step>/checksums/    a checksum (xxh3-128-v1) of every array shard's
                                     bytes, one JSON file per process
                                     (dew.train._integrity)
    <directory>/<step>/commit_success.txt   Orbax's commit marker, written last

A ``fit`` whose directory holds checkpoints continues from the newest usable
one. A save that never finished (no commit marker, or an Orbax temporary
directory ``<step>.orbax-checkpoint-tmp*`` left by a kill) is renamed to
``<step>.unfinished``; a committed checkpoint whose files prove damaged
(missing, truncated, undecodable: the storage layer says so; or an array
that does not match its saved checksum) to ``<step>.unusable``. Nothing is
deleted, one line says why, and the one before it is used. Any other error
while restoring is a mistake, not damage: it stops the run as raised and the
directory is left untouched (see :mod:`dew.train._restore`). When the
directory holds committed checkpoints and none is usable, the run stops with
:class:`NoUsableCheckpointError` rather than start over from step 0, unless
``Checkpoints(..., start_fresh=True)``; unfinished saves held no progress and
never count, whichever run set them aside.

A checkpoint written for another model (an array path, shape or dtype of
``params``, ``averaged`` or ``frozen`` differs) raises
:class:`CheckpointMismatchError` naming the arrays; one written with another
optimizer raises :class:`OptimizerMismatchError`, or with
``Checkpoints(..., reset_optimizer=True)`` keeps everything else and starts a
new optimizer state.

Besides the ``keep`` newest checkpoints, ``keep_best`` keeps the best ones by
an evaluation metric (``best_metric``, ``best_mode``), from the metrics passed
to :meth:`CheckpointSession.save`.

The data stream resumes exactly: an iterator with ``get_state``/``set_state``
(a Grain ``DatasetIterator``, ``dew.data`` readers) is put back where it was;
any other iterator is opened fresh and fast-forwarded past the batches the
run consumed (``step`` batches), which is exact for a deterministic stream.

``load_model(directory)`` rebuilds the model (``dew.nn.models``) and its
weights from the directory alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from dew.nn.keywords import check_keywords
from dew.train._checkpoint_dirs import (
    COMMIT_MARKER,
    check_writable,
    incomplete_because,
    read_text,
    step_dirs,
    sync,
    unfinished_because,
)
from dew.train._integrity import read_recorded, verify
from dew.train._integrity import save_args as checksums_save_args
from dew.train._layout import (
    LAYOUT,
    CheckpointLayoutError,
    disk_layout,
    layout_of,
    run_layout,
)
from dew.train._load_model import load_model
from dew.train._position import (
    _Position,
    iterator_position,
    resume_position,  # noqa: F401 (the trainer imports it from here)
)
from dew.train._restore import (
    CheckpointMismatchError,
    NoUsableCheckpointError,
    OptimizerMismatchError,
    agree,
    check_compatible,
    damage,
    damaged_because,
    jsonable_metrics,
    no_usable_message,
    quiet_orbax,
    quiet_restore,
    unusable_names,
)
from dew.train._saved_tree import from_saved, is_typed_key, to_saved
from dew.train.state import TrainState

__all__ = [
    "CheckpointLayoutError",
    "CheckpointMismatchError",
    "CheckpointSession",
    "Checkpoints",
    "NoUsableCheckpointError",
    "OptimizerMismatchError",
    "Restored",
    "load_model",
]

ITEMS = ("state", "data_iter", "meta", "checksums")
FORMAT = 2  # 2: with checksums of every array (dew.train._integrity)


@check_keywords
@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where and how a run keeps its checkpoints.

    directory: the checkpoint directory (created if missing); a relative path
      is taken from the working directory when the object is built.
    keep: how many of the newest checkpoints to keep; None = all.
    keep_best: also keep this many checkpoints with the best ``best_metric``
      (from the evaluation metrics saved with them), beside the ``keep``
      newest; 0 = keep only the newest. A checkpoint among either is never
      deleted.
    best_metric: the evaluation metric ``keep_best`` ranks by (a key of the
      dict ``objective.summarize`` returns, e.g. ``"loss"``).
    best_mode: ``"min"`` (lower is better) or ``"max"``.
    use_async: write in a background thread while training goes on (the
      arrays are copied to host memory before ``save`` returns); False =
      every save blocks until it is on disk.
    reset_optimizer: when the checkpoint's optimizer state does not match
      this run's optimizer (another optax chain), keep the weights, moving
      average, frozen collections, counters and data position and start a
      new optimizer state (its step counts, and so its schedules, start at
      0) instead of stopping with :class:`OptimizerMismatchError`. A
      matching optimizer state is always restored.
    start_fresh: when the directory holds committed checkpoints but none is
      usable (all set aside as ``<step>.unusable``), start from step 0 instead of
      stopping with :class:`NoUsableCheckpointError`. A usable checkpoint
      is always resumed from.
    """

    directory: str | os.PathLike
    _: dataclasses.KW_ONLY
    keep: int | None = 3
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: str = "min"
    use_async: bool = True
    reset_optimizer: bool = False
    start_fresh: bool = False

    def __post_init__(self):
        if self.keep is not None and self.keep < 1:
            raise ValueError(
                f"Checkpoints.keep must be >= 1 checkpoints or None (all), got {self.keep}"
            )
        if self.keep_best < 0:
            raise ValueError(
                f"Checkpoints.keep_best must be >= 0 checkpoints (0 = none), got {self.keep_best}"
            )
        if self.keep_best and not self.best_metric:
            raise ValueError(
                f"Checkpoints(keep_best={self.keep_best}) needs best_metric=, the name of the "
                f"evaluation metric to rank checkpoints by (e.g. best_metric='loss')"
            )
        if self.best_metric and not self.keep_best:
            raise ValueError(
                f"Checkpoints(best_metric={self.best_metric!r}) keeps nothing without "
                f"keep_best=k (how many of the best checkpoints to keep); set keep_best >= 1"
            )
        if self.best_mode not in ("min", "max"):
            raise ValueError(
                f"Checkpoints.best_mode must be 'min' (lower is better) or 'max', got "
                f"{self.best_mode!r}"
            )
        object.__setattr__(self, "directory", os.path.abspath(os.fspath(self.directory)))

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints in the directory, oldest first."""
        return sorted(
            step for step, path in step_dirs(self.directory) if incomplete_because(path) is None
        )

    def open(self, *, print_fn: Callable[[str], None] = print) -> CheckpointSession:
        """Check the directory can be written and open it for one ``fit``."""
        return CheckpointSession(self, print_fn=print_fn)

    def _rank(self, metrics) -> float:
        """A saved checkpoint's ``best_metric`` as Orbax's ``BestN`` sorts it
        (ascending; the last are kept): missing or NaN ranks worst."""
        value = float((metrics or {}).get(self.best_metric, math.nan))
        if math.isnan(value):
            return math.inf if self.best_mode == "min" else -math.inf
        return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restored:
    """A checkpoint read back.

    step: the step it was written at.
    path: its directory.
    state: the TrainState, sharded like the run's.
    data_state: the training iterator's saved position (its ``get_state()``),
      or None when the iterator could not save one.
    meta: the checkpoint's JSON metadata.
    optimizer_reset: the optimizer state is new (``reset_optimizer=True`` and
      the checkpoint's did not match this run's optimizer).
    """

    step: int
    path: str
    state: TrainState
    data_state: Any
    meta: dict
    optimizer_reset: bool = False


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

    @property
    def manager(self):
        if self._manager is None:
            ocp = self._ocp
            spec = self.spec
            if spec.keep_best:
                from orbax.checkpoint.checkpoint_managers import (
                    AnyPreservationPolicy,
                    BestN,
                    LatestN,
                )

                # best_fn makes Orbax write each step's metrics beside it and read
                # them back when a later run opens the directory; the policy keeps
                # the union of the newest and the best.
                options = ocp.CheckpointManagerOptions(
                    create=True,
                    enable_async_checkpointing=spec.use_async,
                    best_fn=spec._rank,
                    best_mode=spec.best_mode,
                    preservation_policy=AnyPreservationPolicy(
                        [
                            LatestN(n=spec.keep),
                            BestN(
                                get_metric_fn=spec._rank,
                                reverse=spec.best_mode == "min",
                                n=spec.keep_best,
                                keep_checkpoints_without_metrics=False,
                            ),
                        ]
                    ),
                )
            else:
                options = ocp.CheckpointManagerOptions(
                    max_to_keep=spec.keep,
                    create=True,
                    enable_async_checkpointing=spec.use_async,
                )
            with quiet_orbax():
                self._manager = ocp.CheckpointManager(
                    self.directory, options=options, item_names=ITEMS
                )
        return self._manager

    def path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def check_best_metric(self, available: set[str]) -> None:
        """Raise before training when ``keep_best`` ranks by a metric that
        evaluation does not produce; ``available`` are the names it does."""
        spec = self.spec
        if spec.keep_best and spec.best_metric not in available:
            raise ValueError(
                f"Checkpoints(best_metric={spec.best_metric!r}) is not among the metrics "
                f"evaluation produces ({sorted(available) or 'none: no evaluation runs'}); "
                f"use one of them, or drop keep_best"
            )

    # --------------------------------------------------------------- restore
    def restore(
        self,
        abstract: TrainState,
        shardings: TrainState,
        *,
        root_key: jax.Array,
        init_opt_state: Callable[[Any], Any] | None = None,
        model: dict | None = None,
    ) -> Restored | None:
        """The newest usable checkpoint, read into ``shardings``; None when the
        directory holds none (or none is usable and ``start_fresh``).
        Unusable ones are renamed aside with a message; an error that does not
        prove a checkpoint damaged propagates and renames nothing.

        root_key: the run's root key; a typed key's implementation wraps the
          saved key data back into a key.
        init_opt_state: ``params -> opt_state`` sharded like ``shardings``, for
          ``reset_optimizer``.
        """
        key_impl = jax.random.key_impl(root_key) if is_typed_key(root_key) else None
        unusable: list[tuple[int, str, str, bool]] = []  # step, path, why, unfinished
        restored = None
        for step, path in step_dirs(self.directory):
            why = unfinished_because(path)
            unfinished = why is not None
            if not unfinished:
                failed = None
                try:
                    with quiet_restore():
                        restored = self._read(
                            step, path, abstract, shardings, key_impl, init_opt_state, model
                        )
                except Exception as error:
                    failed, restored = error, None
                # several processes: each read its own shards; all decide alike
                failed = agree(failed)
                if failed is None:
                    break
                restored = None  # (this process's shards may have read well)
                proof = damage(failed)
                if proof is None:  # a mistake, not damage: nothing is renamed
                    raise failed
                why = damaged_because(proof)
            unusable.append((step, path, why, unfinished))
        earlier = unusable_names(self.directory, COMMIT_MARKER)
        lost = []  # what held progress: saves that never finished held none
        for step, path, why, unfinished in unusable:
            target = self._set_aside(step, path, why, unfinished=unfinished)
            if not unfinished:
                lost.append((path, target, why))
        if restored is not None:
            if restored.optimizer_reset:
                self.print(
                    f"Checkpoint {restored.path}: its optimizer state does not match this run's "
                    f"optimizer; keeping its weights, counters and data position and starting "
                    f"a new optimizer state (Checkpoints(reset_optimizer=True))"
                )
            return restored
        if not lost and not earlier:
            return None
        message = no_usable_message(
            self.directory, lost, earlier, fresh_hint=not self.spec.start_fresh
        )
        if not self.spec.start_fresh:
            raise NoUsableCheckpointError(message)
        self.print(f"Starting from step 0 (Checkpoints(start_fresh=True)): {message}")
        return None

    def _read(
        self, step, path, abstract, shardings, key_impl, init_opt_state, model=None
    ) -> Restored:
        ocp = self._ocp
        meta = json.loads(read_text(os.path.join(path, "meta", "metadata")))
        # this run's tree, and the same in the checkpoint's layout (an earlier format's)
        run_abstract = to_saved(abstract, shardings=shardings)
        saved_abstract = disk_layout(run_abstract, layout_of(path, meta))
        state_dir = os.path.join(path, "state")
        with ocp.StandardCheckpointer() as checkpointer:
            saved = getattr(checkpointer.metadata(state_dir), "item_metadata", None)
            if saved is None:
                # Orbax returns no metadata when it cannot read it, without saying
                # why; reading the files does (a missing or undecodable file, a
                # storage error), and an intact state restores.
                json.loads(read_text(os.path.join(state_dir, "_METADATA")))
                reset = False
            else:
                reset = check_compatible(
                    saved_abstract,
                    saved.tree,
                    path,
                    meta,
                    reset_optimizer=self.spec.reset_optimizer,
                    directory=self.directory,
                    this_model=model,
                )
            if not reset:
                tree = checkpointer.restore(state_dir, saved_abstract)
                self._verify(path, tree, meta)
                tree = run_layout(tree, run_abstract)
        if reset:
            if init_opt_state is None:
                raise ValueError(
                    "Checkpoints(reset_optimizer=True) needs init_opt_state= in "
                    "CheckpointSession.restore to build the new optimizer state"
                )
            target = {k: v for k, v in saved_abstract.items() if k != "opt_state"}
            tree = ocp.PyTreeCheckpointer().restore(
                state_dir,
                args=ocp.args.PyTreeRestore(
                    item=target,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    partial_restore=True,
                ),
            )
            self._verify(path, tree, meta)
            tree = {**target, **tree}
            tree = run_layout(tree, {k: v for k, v in run_abstract.items() if k != "opt_state"})
            tree["opt_state"] = init_opt_state(tree["params"])
        state = from_saved(tree, key_impl=key_impl, key_sharding=shardings.key)
        state = state.with_structure(abstract)
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
        return Restored(
            step=step,
            path=path,
            state=state,
            data_state=data_state,
            meta=meta,
            optimizer_reset=reset,
        )

    def _verify(self, path: str, tree, meta: dict) -> None:
        """Check the arrays read from ``path`` against the checksums saved with
        them (:mod:`dew.train._integrity`); a checkpoint without them is read as
        it is, with a note, only where its format predates them (else it is damaged:
        ``ChecksumsMissingError``)."""
        recorded = read_recorded(path, format=meta.get("format"))
        if recorded is None:
            self.print(
                f"Note: checkpoint {path} has no checksums of its arrays (written by an "
                f"earlier version of Dew); its arrays are restored unverified"
            )
            return
        verify(tree, recorded)

    def _set_aside(self, step: int, path: str, why: str, *, unfinished: bool) -> str:
        """Rename ``path`` aside: ``<step>.unfinished`` for a save that never
        finished (it never held progress), ``<step>.unusable`` for a committed
        checkpoint proven damaged."""
        suffix = "unfinished" if unfinished else "unusable"
        target = os.path.join(self.directory, f"{step}.{suffix}")
        n = 1
        while os.path.exists(target):
            target = os.path.join(self.directory, f"{step}.{suffix}-{n}")
            n += 1
        if jax.process_index() == 0:
            os.rename(path, target)
        sync("dew-checkpoint-set-aside")
        self.print(f"Skipping checkpoint {path}: {why}; kept as {target}, nothing deleted")
        return target

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        state: TrainState,
        iterator: Iterator,
        meta: dict,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """Start writing a checkpoint of ``state`` and the iterator's position
        at ``step`` (asynchronously unless ``use_async=False``).

        metrics: the latest evaluation results (``{name: float}``), or None
          when there are none yet; ``keep_best`` ranks checkpoints by them.
        """
        ocp = self._ocp
        import grain

        spec = self.spec
        metrics = jsonable_metrics(metrics)
        if spec.keep_best and metrics is not None and spec.best_metric not in metrics:
            raise ValueError(
                f"checkpoint of step {step}: the metrics given to save have no "
                f"{spec.best_metric!r} (Checkpoints.best_metric), only {sorted(metrics)}; "
                f"pass the evaluation results that include it, or None"
            )
        position = iterator_position(iterator)
        meta = {
            **meta,
            "format": FORMAT,
            "layout": LAYOUT,  # dew.train._layout
            "step": step,
            "data": "position" if position is not None else "fast-forward",
        }
        saved = to_saved(state)
        items = {
            "state": ocp.args.StandardSave(saved),
            "meta": ocp.args.JsonSave(meta),
        }
        checksums = items["checksums"] = checksums_save_args(saved, deferred=spec.use_async)
        if position is not None:
            items["data_iter"] = grain.checkpoint.CheckpointSave(_Position(position))
        try:
            with quiet_orbax():
                self.manager.save(
                    step,
                    args=ocp.args.Composite(**items),
                    force=True,
                    metrics=metrics if spec.keep_best else None,
                )
        finally:
            checksums.started.set()  # the sums start in the background now

    def wait(self) -> None:
        """Block until every started save is on disk."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None
