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

import errno
import json
import re
import zlib
from typing import Any

import jax
import numpy as np

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
def _key_name(key) -> str:
    """A key path entry as Orbax names it (``orbax`` ``get_key_name``)."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


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
            name = "/".join(_key_name(k) for k in path)
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
    saved_abstract, saved_metadata, path: str, meta: dict, *, reset_optimizer: bool, directory: str
) -> bool:
    """Raise unless the checkpoint at ``path`` fits this run; return True when
    only its optimizer state differs and ``reset_optimizer`` allows starting
    a new one.

    saved_abstract: this run's tree as :func:`dew.train.checkpoints.to_saved`
      writes it, abstract. saved_metadata: the checkpoint's Orbax metadata tree.
    """
    ours, theirs = flat_arrays(saved_abstract), flat_arrays(saved_metadata)
    model_fields = {name.split("/", 1)[0] for name in (*ours, *theirs)} - {"opt_state"}
    model = _differences(ours, theirs, model_fields)
    if model:
        written = meta.get("model") or {}
        by = (
            f" (written for model {written.get('name')!r} with config {written.get('config')})"
            if written
            else ""
        )
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
# TensorStore reports storage failures as ValueError("<STATUS>: ...").
_STORAGE_STATUS = re.compile(
    r"^(NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|UNAVAILABLE|INVALID_ARGUMENT): "
    r".*(Error reading|Error opening|Error decoding|Error parsing|Truncated|corrupt|checksum|"
    r"byte range|OCDBT|manifest)",
    re.S | re.I,
)


def _is_storage_error(error: BaseException) -> bool:
    if isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError, EOFError)):
        return True
    if isinstance(error, OSError) and error.errno in (errno.EIO, errno.ENODATA):
        return True
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError, zlib.error)):
        return True
    return isinstance(error, ValueError) and bool(_STORAGE_STATUS.match(str(error)))


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


def describe(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}"


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


def unusable_names(names: list[str]) -> list[str]:
    """The names of set-aside checkpoints among a directory's entries."""
    return sorted(n for n in names if re.match(r"^\d+\.unusable(-\d+)?$", n))


def jsonable_metrics(metrics: dict[str, Any] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    return {str(name): float(value) for name, value in metrics.items()}
