"""Checksums of a checkpoint's arrays, written with it and verified when it is read.

Why Dew keeps its own: Orbax writes each array as zarr chunks, zstd-compressed,
inside an OCDBT database. OCDBT checks its b-tree nodes (a CRC-32C), which hold
small values inline (up to 1 KiB, Orbax's setting), but a larger chunk is stored
outside them and nothing checks its bytes: a single flipped bit in it can
decode, without an error, to other numbers (``test_checkpoints.py``,
``test_a_flipped_bit_the_storage_layer_misses_is_caught_by_the_checksum``).
Orbax's zarr3 layout checksums only its shard index, and Orbax offers no
setting for a chunk checksum codec.

What is recorded: every process writes ``<step>/checksums/process_<i>-of-<n>.json``
with the CRC-32 (``zlib.crc32``) of the bytes (C order) of each of its
addressable shards, one entry per distinct shard index of every array of the
saved tree (``{"params/embed/embedding": {"[0:4, 0:16]": crc, ...}}``). The
shards are taken from device when ``save`` is called (host views on CPU, where
they are the arrays Orbax writes too) and the sums computed in Orbax's
background commit thread, so an asynchronous save does not wait for them; the
checkpoint commits only after they are written.

What is verified: after a restore, each process recomputes the sums of the
shards it holds whose index was recorded (any process's record: the same mesh
layout restores every shard verified; on one process, any recorded index of a
fully addressable array is cut from it). A mismatch raises
:class:`ChecksumMismatchError`, naming the array; with several processes every
process learns that one found a mismatch, so all set the checkpoint aside.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import zlib
from typing import Any

import jax
import numpy as np

ITEM = "checksums"
ALGORITHM = "crc32"


class ChecksumMismatchError(ValueError):
    """An array read back from a checkpoint differs from the one saved: its
    files are damaged."""

    def __init__(self, name: str, index: str, saved: int, read: int):
        self.name = name
        super().__init__(
            f"array {name!r} (shard {index}) does not match the checksum saved with it "
            f"({ALGORITHM} {saved:#010x} saved, {read:#010x} read back)"
        )

    @classmethod
    def on_process(cls, process: int) -> ChecksumMismatchError:
        """The error on a process whose own shards matched while ``process``'s did not."""
        error = cls.__new__(cls)
        error.name = None
        ValueError.__init__(
            error,
            f"an array shard held by process {process} does not match the checksum saved "
            f"with it (its log names the array)",
        )
        return error


def checksum(array: np.ndarray) -> int:
    """CRC-32 of an array's bytes in C order."""
    data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return zlib.crc32(data)


def index_key(index: tuple, shape: tuple[int, ...]) -> str:
    """A shard's place in its array, ``"[0:4, 0:16]"`` (``"[]"`` for a scalar)."""
    parts = []
    for part, size in zip(index, shape, strict=True):
        start, stop, _ = part.indices(size)
        parts.append(f"{start}:{stop}")
    return f"[{', '.join(parts)}]"


def _slices(key: str) -> tuple[slice, ...]:
    inner = key[1:-1]
    if not inner:
        return ()
    return tuple(slice(*map(int, part.split(":"))) for part in inner.split(", "))


def _named_leaves(tree) -> list[tuple[str, Any]]:
    from dew.train._restore import path_name

    return [
        (path_name(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(leaf, "shape")
    ]


def host_shards(tree) -> list[tuple[str, str, np.ndarray]]:
    """``(array name, shard index, host data)`` of this process's shards of
    every array in ``tree``, each distinct index once. Taken at once: the
    device buffers stay referenced until the sums are computed."""
    out = []
    pending = []
    for name, leaf in _named_leaves(tree):
        if not isinstance(leaf, jax.Array):
            out.append((name, index_key((slice(None),) * np.ndim(leaf), np.shape(leaf)), leaf))
            continue
        seen = set()
        for shard in leaf.addressable_shards:
            key = index_key(shard.index, leaf.shape)
            if key in seen:
                continue
            seen.add(key)
            shard.data.copy_to_host_async()
            pending.append((name, key, shard.data))
    out += [(name, key, np.asarray(data)) for name, key, data in pending]
    return out


def _sums(shards: list[tuple[str, str, np.ndarray]]) -> list[int]:
    # zlib.crc32 releases the GIL on large buffers: threads share the work
    workers = min(8, os.cpu_count() or 1)
    if workers == 1 or len(shards) < 2:
        return [checksum(data) for _, _, data in shards]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(checksum, (data for _, _, data in shards)))


def record(shards: list[tuple[str, str, np.ndarray]]) -> dict:
    """The JSON record of this process's shards."""
    arrays: dict[str, dict[str, int]] = {}
    for (name, key, _), value in zip(shards, _sums(shards), strict=True):
        arrays.setdefault(name, {})[key] = value
    return {"algorithm": ALGORITHM, "arrays": arrays}


def _filename() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def read_recorded(path: str) -> dict[str, dict[str, int]] | None:
    """Every process's recorded sums of the checkpoint at ``path``, merged;
    None for a checkpoint written without them."""
    directory = os.path.join(path, ITEM)
    if not os.path.isdir(directory):
        return None
    merged: dict[str, dict[str, int]] = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("process_") and name.endswith(".json")):
            continue
        with open(os.path.join(directory, name)) as f:
            content = json.load(f)
        if content.get("algorithm") != ALGORITHM:
            raise ValueError(
                f"checkpoint {path}: {ITEM}/{name} uses checksum {content.get('algorithm')!r}, "
                f"which this version of Dew does not know (it knows {ALGORITHM!r}); "
                f"resume with the Dew version that wrote it"
            )
        for array, shards in content["arrays"].items():
            merged.setdefault(array, {}).update(shards)
    return merged


def verify(tree, recorded: dict[str, dict[str, int]]) -> int:
    """Raise :class:`ChecksumMismatchError` unless every recorded shard this
    process can see matches; return how many shards it verified."""
    checked, mismatch = [], None
    for name, leaf in _named_leaves(tree):
        saved = recorded.get(name)
        if not saved:
            continue
        local = {}
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                local.setdefault(index_key(shard.index, leaf.shape), shard.data)
        else:
            local[index_key((slice(None),) * np.ndim(leaf), np.shape(leaf))] = leaf
        whole = None
        for key, value in saved.items():
            if key in local:
                data = np.asarray(local[key])
            elif not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
                whole = np.asarray(leaf) if whole is None else whole  # another layout
                data = whole[_slices(key)]
            else:
                continue  # another process holds it
            checked.append((name, key, value, data))
    sums = _sums([(name, key, data) for name, key, _, data in checked])
    for (name, key, value, _), got in zip(checked, sums, strict=True):
        if got != value:
            mismatch = ChecksumMismatchError(name, key, value, got)
            break
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(mismatch is not None))
        if mismatch is None and np.any(flags):
            raise ChecksumMismatchError.on_process(int(np.argmax(flags)))
    if mismatch is not None:
        raise mismatch
    return len(checked)


# ------------------------------------------------------- the Orbax item
def _handler_classes():
    """The Orbax handler and its save/restore args, defined on first use (Orbax
    is imported only by runs that checkpoint)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.futures import future
    from orbax.checkpoint._src.handlers import async_checkpoint_handler

    class ChecksumsHandler(async_checkpoint_handler.AsyncCheckpointHandler):
        """Writes this process's record; the sums are computed in the commit
        thread, before the checkpoint commits."""

        async def _write(self, shards, directory):
            content = json.dumps(record(shards), indent=0)
            (directory / _filename()).write_text(content)

        async def async_save(self, directory, args):
            return [
                future.CommitFutureAwaitingContractedSignals(
                    self._write(args.shards, directory), name="dew_checksums_save"
                )
            ]

        def save(self, directory, args):
            (directory / _filename()).write_text(json.dumps(record(args.shards), indent=0))

        def restore(self, directory, args=None):
            return read_recorded(os.fspath(directory.parent))

        def metadata(self, directory):
            return None

        def structure(self, directory):
            return None

        def finalize(self, directory):
            pass

        def close(self):
            pass

    @ocp.args.register_with_handler(ChecksumsHandler, for_save=True)
    @dataclasses.dataclass
    class ChecksumsSave(ocp.args.CheckpointArgs):
        shards: list

    @ocp.args.register_with_handler(ChecksumsHandler, for_restore=True)
    @dataclasses.dataclass
    class ChecksumsRestore(ocp.args.CheckpointArgs):
        pass

    _CLASSES = (ChecksumsHandler, ChecksumsSave, ChecksumsRestore)
    return _CLASSES


_CLASSES = None


def save_args(tree):
    """The Orbax args that write ``tree``'s checksums as the ``checksums`` item."""
    return _handler_classes()[1](host_shards(tree))
