"""What a restore decides about a checkpoint: does it match this run, and
does an error reading it prove the files unusable or is it a mistake.

Two questions with different answers:

- *Does it match?* The saved tree's array paths, shapes and dtypes are
  compared with this run's, from the checkpoint's metadata alone. A
  different model (``params``, ``averaged``, ``frozen``, the counters) is a
  :class:`CheckpointMismatchError`; a different optimizer (only ``opt_state``
  differs) an :class:`OptimizerMismatchError`, which ``Checkpoints(...,
  reset_optimizer=True)`` turns into a fresh optimizer state.
- *Is it damaged?* Only an error that proves the files unusable sets a
  checkpoint aside: a file that is missing, truncated or undecodable, as
  the storage layer reports it (an ``OSError`` for a missing file, a JSON or
  UTF-8 decode error, a TensorStore status such as ``NOT_FOUND``,
  ``DATA_LOSS``, ``OUT_OF_RANGE``). Anything else (a ``TypeError`` in code,
  an ``AssertionError`` in a library) is a mistake to fix, not damage: it
  propagates and the directory is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import sys
import zlib
from typing import Any

import jax
import numpy as np

from dew.nn import models
from dew.train._integrity import ChecksumMismatchError, ChecksumsMissingError, path_name

MODEL_FIELDS = ("params", "averaged", "frozen")
SHOWN = 6  # differences listed in one message


class CheckpointMismatchError(ValueError):
    """A checkpoint was written for another model or optimizer than this run's."""


class OptimizerMismatchError(CheckpointMismatchError):
    """A checkpoint's optimizer state differs from this run's optimizer; the
    model matches."""


class NoUsableCheckpointError(RuntimeError):
    """The checkpoint directory holds checkpoints, none of them usable."""


# ---------------------------------------------------------------- the trees
def flat_arrays(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{'opt_state/1/0/mu/w': (shape, dtype name)}`` of every array leaf.

    Works on this run's tree of ``jax.ShapeDtypeStruct`` and on Orbax's
    metadata tree alike: both flatten to the same '/'-joined names (a
    namedtuple's fields by name, a tuple's entries by index). Leafless
    nodes (optax's ``EmptyState``, ``MaskedNode``, None) hold no array and
    have no name, so their position in a tuple does not matter.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape"):
            name = path_name(path)
            dtype = getattr(leaf, "dtype", None)
            out[name] = (tuple(leaf.shape), str(np.dtype(dtype)) if dtype is not None else "?")
    return out


def _differences(ours: dict, theirs: dict, fields) -> list[str]:
    """One line per array whose presence, shape or dtype differs, for names
    under ``fields`` (the first path component)."""

    def mine(name):
        return name.split("/", 1)[0] in fields

    def order(name):  # parameters first: a different model shows as its weights
        field = name.split("/", 1)[0]
        return (MODEL_FIELDS.index(field) if field in MODEL_FIELDS else len(MODEL_FIELDS), name)

    lines = []
    for name in sorted((n for n in ours if mine(n)), key=order):
        shape, dtype = ours[name]
        if name not in theirs:
            lines.append(f"{name!r} (shape {shape}) is not in the checkpoint")
            continue
        saved_shape, saved_dtype = theirs[name]
        if saved_shape != shape:
            lines.append(
                f"{name!r} has shape {saved_shape} in the checkpoint and {shape} in this run"
            )
        elif saved_dtype != dtype:
            lines.append(
                f"{name!r} has dtype {saved_dtype} in the checkpoint and {dtype} in this run"
            )
    for name in sorted((n for n in theirs if mine(n) and n not in ours), key=order):
        lines.append(f"{name!r} (shape {theirs[name][0]}) is in the checkpoint but not in this run")
    return lines


def _shown(lines: list[str]) -> str:
    more = f"; and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
    return "; ".join(lines[:SHOWN]) + more


def check_compatible(
    saved_abstract,
    saved_metadata,
    path: str,
    meta: dict,
    *,
    reset_optimizer: bool,
    directory: str,
    this_model: dict | None = None,
) -> bool:
    """Raise unless the checkpoint at ``path`` fits this run; return True when
    only its optimizer state differs and ``reset_optimizer`` allows starting
    a new one.

    saved_abstract: this run's tree as :func:`dew.train.checkpoints.to_saved`
      writes it, abstract. saved_metadata: the checkpoint's Orbax metadata tree.
    this_model: this run's ``{"name", "config"}`` record; a model mismatch then names
      the configuration fields that differ, not the whole saved configuration.
    """
    ours, theirs = flat_arrays(saved_abstract), flat_arrays(saved_metadata)
    model_fields = {name.split("/", 1)[0] for name in (*ours, *theirs)} - {"opt_state"}
    model = _differences(ours, theirs, model_fields)
    if model:
        written = meta.get("model") or {}
        by = ""
        if written and this_model:
            lines = models.config_differences(
                written, this_model, saved_label="the checkpoint", current_label="this run"
            )
            by = f" (it differs in {'; '.join(lines)})" if lines else ""
        elif written:
            by = f" (written for model {written.get('name')!r} with config {written.get('config')})"
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match this run's model{by}: {_shown(model)}; resume "
            f"with the model that wrote it, or point Checkpoints at another directory"
        )
    optimizer = _differences(ours, theirs, {"opt_state"})
    if not optimizer:
        return False
    if reset_optimizer:
        return True
    parameters = {n.split("/", 1)[1] for n in ours if n.startswith("params/")}
    raise OptimizerMismatchError(
        f"checkpoint {path} was written with another optimizer: the model matches but the "
        f"optimizer state does not. Saved: {_structure(theirs, parameters)}; this run's "
        f"optimizer: {_structure(ours, parameters)} ('*' = one array per parameter). First "
        f"differences: {'; '.join(optimizer[:3])}. Resume with the optimizer that wrote it, or "
        f"pass Checkpoints({directory!r}, reset_optimizer=True) to keep the weights, moving "
        f"average, frozen collections, counters and data position and start a new optimizer "
        f"state"
    )


def _structure(flat: dict, parameters: set[str]) -> str:
    """The optimizer state's layout: its array paths with a parameter's path
    written ``*`` (``opt_state/0/mu/*``), each once, with the array count."""
    layout = []
    names = sorted(n for n in flat if n.startswith("opt_state/"))
    for name in names:
        parts = name.split("/")
        for cut in range(1, len(parts)):
            if "/".join(parts[cut:]) in parameters:
                name = "/".join(parts[:cut]) + "/*"
                break
        if name not in layout:
            layout.append(name)
    return f"{len(names)} arrays [{', '.join(layout)}]"


# ------------------------------------------------------------------- damage
# TensorStore reports storage failures as ValueError, with a leading status
# ("DATA_LOSS: Error reading ...") or, through Orbax's driver stack, without one
# ('Error opening "cast" driver: Error opening "zarr" driver: Error reading
# "key/.zarray" in OCDBT database ...: Error decoding b-tree node:
# ZSTD_decompressStream() failed: Data corruption detected; ...').
_STORAGE_STATUS = re.compile(
    r"^(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|UNAVAILABLE|INVALID_ARGUMENT): "
    r".*(Error reading|Error opening|Error decoding|Error parsing|Truncated|corrupt|checksum|"
    r"byte range|OCDBT|manifest)",
    re.S | re.I,
)
_TENSORSTORE_DAMAGE = re.compile(
    r'^Error (opening|reading|decoding) ".*'
    r"(Error decoding|Data corruption|corrupt|checksum|Truncated|Unexpected end of|ZSTD_|"
    r"Invalid magic|Error reading .* (byte range|local file))",
    re.S | re.I,
)


def _is_storage_error(error: BaseException) -> bool:

    if isinstance(error, ChecksumMismatchError | ChecksumsMissingError | DamageOnProcess):
        return True
    if isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError, EOFError)):
        return True
    if isinstance(error, OSError) and error.errno in (errno.EIO, errno.ENODATA):
        return True
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError, zlib.error)):
        return True
    if not isinstance(error, ValueError):
        return False
    text = str(error)
    return bool(_STORAGE_STATUS.match(text) or _TENSORSTORE_DAMAGE.match(text))


def damage(error: BaseException) -> BaseException | None:
    """The storage-layer error in ``error``'s chain (itself, its cause or the
    error it was raised while handling) that proves the checkpoint's files
    unusable, or None when nothing does (a mistake: let it propagate)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _is_storage_error(error):
            return error
        error = error.__cause__ or error.__context__
    return None


_ARRAY_KEY = re.compile(r'Error reading "([^"]+?)/(?:\.z\w+|c/[\d/]*|[\d.]+)" in OCDBT')
_FILE = re.compile(r'(local file "[^"]+")')


def describe(error: BaseException) -> str:
    """One short line for a storage error: the array and file TensorStore
    names, and its innermost reason (without the JSON specs it appends)."""
    text = " ".join(str(error).split())
    text = re.split(r" \[tensorstore_spec", text, maxsplit=1)[0]
    status = re.match(r"^[A-Z_]+: ", text)
    body = text[status.end() :] if status else text
    if isinstance(error, ValueError) and body.startswith("Error "):
        array = _ARRAY_KEY.search(body)
        files = _FILE.findall(body)
        parts = body.split(": ")
        last = max(i for i, part in enumerate(parts) if part.startswith("Error "))
        reason = re.split(r"; at ", ": ".join(parts[last:]), maxsplit=1)[0]
        where = f"array {array.group(1).replace('.', '/')!r}: " if array else ""
        at = f" in {files[-1]}" if files else ""
        code = status.group(0) if status else ""
        return f"{type(error).__name__}: {code}{where}{reason[:200]}{at}"[:400]
    return f"{type(error).__name__}: {text[:300]}"


def damaged_because(proof: BaseException) -> str:
    """Why a checkpoint is set aside, from the error that proves it damaged."""

    if isinstance(proof, ChecksumMismatchError | ChecksumsMissingError):
        return f"it is damaged: {proof}"
    if isinstance(proof, DamageOnProcess):
        return f"it cannot be read on process {proof.process} ({proof.why})"
    return f"it cannot be read ({describe(proof)})"


# ------------------------------------------------------- several processes
class DamageOnProcess(ValueError):
    """Another process proved a checkpoint damaged while reading its shards."""

    def __init__(self, process: int, why: str):
        self.process, self.why = process, why
        super().__init__(f"process {process} found the checkpoint damaged: {why}")


_SHARED_BYTES = 4096  # room for one process's outcome (JSON)


def agree(error: BaseException | None) -> BaseException | None:
    """Each process's outcome of reading one checkpoint (``error``: None when it
    read its shards), shared so that every process decides alike: None when all
    read it, else the first failing process's error as each process sees it. A
    checksum mismatch comes back as a :class:`ChecksumMismatchError` naming the
    array, its shard and the process; other damage as the process's own error
    there and a :class:`DamageOnProcess` elsewhere; a mistake (not damage) as it
    was raised there and a ``RuntimeError`` elsewhere, which stops every process.
    On one process, ``error`` itself."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils

    proof = None if error is None else damage(error)
    if error is None:
        mine = None
    elif isinstance(proof, ChecksumMismatchError):
        mine = ["mismatch", proof.name, proof.index, proof.saved, proof.read, proof.algorithm]
    elif proof is not None:
        mine = ["damage", describe(proof)]
    else:
        mine = ["mistake", f"{type(error).__name__}: {error}"[:1000]]
    encoded = np.zeros(_SHARED_BYTES, np.uint8)
    if mine is not None:
        data = np.frombuffer(json.dumps(mine).encode()[: _SHARED_BYTES - 1], np.uint8)
        encoded[: len(data)] = data
        encoded[_SHARED_BYTES - 1] = 1  # failed, whatever fits
    shared = np.asarray(multihost_utils.process_allgather(encoded))
    for process, row in enumerate(shared.reshape(-1, _SHARED_BYTES)):
        if not row[-1]:
            continue
        try:
            kind, *fields = json.loads(row[:-1].tobytes().rstrip(b"\0"))
        except ValueError:  # cut short: what is known
            kind, fields = "mistake", ["an error too long to share"]
        if kind == "mismatch":
            name, index, saved, read, algorithm = fields
            return ChecksumMismatchError(name, index, saved, read, algorithm, process=process)
        if process == jax.process_index():
            return error
        if kind == "damage":
            return DamageOnProcess(process, fields[0])
        return RuntimeError(
            f"process {process} stopped reading the checkpoint with an error that is not "
            f"damage ({fields[0]}); its output has the traceback"
        )
    return None


def no_usable_message(
    directory: str, set_aside: list[tuple[str, str, str]], earlier: list[str], *, fresh_hint: bool
) -> str:
    """The error for a directory that holds checkpoints, none usable.

    set_aside: ``(path, kept as, why)`` for this restore; earlier: directories
    an earlier run set aside.
    """
    parts = [f"{path} kept as {target} ({why})" for path, target, why in set_aside]
    if earlier:
        parts.append(f"set aside by an earlier run: {', '.join(earlier)}")
    hint = (
        f"; to start over from step 0, pass Checkpoints({directory!r}, start_fresh=True) "
        f"(the set-aside directories stay where they are)"
        if fresh_hint
        else ""
    )
    return (
        f"no usable checkpoint in {directory}, so this run would start over from step 0 and "
        f"lose the progress they held: {'; '.join(parts)}. Nothing was deleted: check the "
        f"storage, or move an intact copy back to <step>/{hint}"
    )


UNUSABLE = re.compile(r"^\d+\.unusable(-\d+)?$")  # a committed checkpoint, proven damaged
UNFINISHED = re.compile(r"^\d+\.unfinished(-\d+)?$")  # a save that never finished


def unusable_names(directory: str, commit_marker: str) -> list[str]:
    """The set-aside checkpoints in ``directory`` that held progress: committed
    ones proven damaged (``<step>.unusable``). Saves that never finished are set
    aside as ``<step>.unfinished`` and never count; neither does a
    ``<step>.unusable`` without a commit marker (earlier versions of Dew set
    unfinished saves aside under that name too)."""
    return sorted(
        name
        for name in os.listdir(directory)
        if UNUSABLE.match(name) and os.path.exists(os.path.join(directory, name, commit_marker))
    )


def jsonable_metrics(metrics: dict[str, Any] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    return {str(name): float(value) for name, value in metrics.items()}


# ------------------------------------------------------------------- quiet
@contextlib.contextmanager
def quiet_orbax():
    """Orbax logs through absl at INFO/WARNING for routine operations; keep
    stdout to Dew's own lines while it works."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def quiet_restore():
    """A restore that may fail on damaged files, with Orbax's logs kept quiet.

    When a read fails, Orbax's event loop closes while TensorStore still has
    reads in flight: each one, finishing later on TensorStore's threads,
    reports ``RuntimeError: Event loop is closed`` through
    ``sys.unraisablehook``, and asyncio logs every other failed read as
    ``Future exception was never retrieved`` (about 300 lines of tracebacks
    for one damaged checkpoint), some of them before the failure reaches Dew.
    From the first restore on, those two reports, and only those, are dropped
    for the rest of the process (a filter on the ``asyncio`` logger and a
    ``sys.unraisablehook`` that passes everything else to the previous hook):
    the loop they address is gone, and Dew reports the failure in one line."""
    _drop_closed_loop_reports()
    with quiet_orbax():
        yield


def _is_closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _UnretrievedDamage(logging.Filter):
    """asyncio's report of a failed read nobody awaited once the restore had failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if "exception was never retrieved" in record.getMessage() and error is not None:
            return not (_is_closed_loop(error) or damage(error) is not None)
        return True


_FILTER = _UnretrievedDamage()


def _drop_closed_loop_reports() -> None:
    logger = logging.getLogger("asyncio")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    if getattr(sys.unraisablehook, "_dew_closed_loop", False):
        return
    previous = sys.unraisablehook  # another hook set since (pytest's, per test) is kept

    def hook(unraisable):
        if not _is_closed_loop(unraisable.exc_value):
            previous(unraisable)

    hook._dew_closed_loop = True
    sys.unraisablehook = hook
