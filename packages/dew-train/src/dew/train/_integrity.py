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
with a checksum of the bytes (C order, little-endian) of each of its addressable
shards, one entry per distinct shard index of every array of the saved tree
(``{"algorithm": "xxh3-128-v1", "arrays": {"params/embed/embedding": {"[0:4, 0:16]":
"<32 hex digits>", ...}}}``). The shards are taken from device when ``save`` is
called (host views on CPU, where they are the arrays Orbax writes too) and the
sums computed in Orbax's background commit thread once ``save`` has returned,
so an asynchronous save does not wait for them nor share the CPU with them;
the checkpoint commits only after they are written.

The algorithm, ``xxh3-128-v1`` (:func:`xxh3_128`): XXH3's 128-bit hash of the
bytes (the ``xxhash`` library, the reference C implementation). It reads memory at
about 40 GB/s of one core here, 6x the speed of ``wsum64-v1`` and 16x ``zlib.crc32``
(``tools/bench_checkpoints.py``), so verifying a restore costs about 1.5% of Orbax's
own CPU (the goal: <= 5%). Damage of any kind (a flipped bit, zeroed or shifted
runs, swapped blocks, a truncated read) leaves the hash unchanged with a chance of
about 2**-128; ``test_integrity.py`` flips every bit of an array and pairs of bits,
and zeroes, swaps and truncates runs, against each algorithm.

Checkpoints written by earlier versions of Dew record ``wsum64-v1`` or ``crc32`` and
still verify against them. ``wsum64-v1`` (:func:`wsum64`): the bytes read as little-endian
64-bit words ``w_k`` (the last one zero-padded), k = 1..N, and four sums mod
2**64: ``S = sum w_k``, ``T = sum k*w_k``, and the same of the words' upper
halves, ``S' = sum (w_k >> 32)``, ``T' = sum k*(w_k >> 32)``. Numpy computes
them in one pass over memory (``T`` from row and column sums of the words seen
as a matrix, a block in cache at a time), with 1.3-1.8x less CPU than
``zlib.crc32`` (``tools/bench_checkpoints.py``). What it detects, for a shard under
2**32 words (32 GiB), argued here and checked in ``test_integrity.py``:
any change confined to one word (every flipped bit, every run of up to 8 bytes
set to anything, ``S``), any change confined to two words (every pair of
flipped bits, every run of up to 9 bytes: ``S'`` and ``T'`` pin the upper
halves' changes, then ``S`` and ``T`` the lower ones, since a difference of
positions times a change under 2**32 cannot vanish mod 2**64; a plain
weighted sum of whole words misses, for one, the same top bit flipped in two
words an even distance apart), and longer changes unless they happen to leave
all four sums as they were (for damage unrelated to the sums, a chance of
about 2**-64): zeroed runs, blocks read from the wrong place (``T`` weighs a
word by its position, so swapped blocks change it), a truncated read (zeros
where data was). Swapped shards fail because each index has its own sum.
``crc32`` is ``zlib.crc32`` of the bytes (Dew before ``wsum64-v1``).

What is verified: after a restore, each process recomputes the sums of the
shards it holds whose index was recorded (any process's record: the same mesh
layout restores every shard verified; on one process, any recorded index of a
fully addressable array is cut from it). A mismatch raises
:class:`ChecksumMismatchError`, naming the array; with several processes the
restore shares every process's outcome (:func:`dew.train._restore.agree`), so all
set the checkpoint aside and process 0's line names the array, its shard and the
process that holds it (``tests/test_multiprocess_restore.py``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sys
import threading
import zlib
from typing import Any

import jax
import numpy as np

ITEM = "checksums"
ALGORITHM = "xxh3-128-v1"  # what a save records
WITH_CHECKSUMS = 2  # the first checkpoint format (meta "format") that records them


class ChecksumMismatchError(ValueError):
    """An array read back from a checkpoint differs from the one saved: its
    files are damaged."""

    def __init__(
        self,
        name: str,
        index: str,
        saved,
        read,
        algorithm: str = ALGORITHM,
        *,
        process: int | None = None,
    ):
        self.name, self.index, self.process = name, index, process
        self.saved, self.read, self.algorithm = saved, read, algorithm
        held = "" if process is None else f" held by process {process}"
        super().__init__(
            f"array {name!r} (shard {index}){held} does not match the checksum saved with "
            f"it ({algorithm} {_shown(saved)} saved, {_shown(read)} read back)"
        )


class ChecksumsMissingError(ValueError):
    """A checkpoint whose format records checksums has none: its files are damaged
    (a folder lost), and its arrays cannot be verified."""

    def __init__(self, path: str, format: int):
        self.path, self.format = path, format
        super().__init__(
            f"its {ITEM}/ folder is missing, though it was written with checksums of its "
            f"arrays (checkpoint format {format}), so its arrays cannot be verified"
        )


def _shown(value) -> str:
    return f"{value:#010x}" if isinstance(value, int) else str(value)


def _bytes(array) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def crc32(array) -> int:
    """``zlib.crc32`` of an array's bytes in C order: the ``crc32`` algorithm."""
    return zlib.crc32(_bytes(array))


_COLUMNS = 1024  # words per row of the matrix the words are seen as (8 KiB)
_BLOCK_ROWS = 64  # rows summed at a time (512 KiB, in cache for the second sum)
_MASK = (1 << 64) - 1


def _position_sums(rows: np.ndarray, cols: np.ndarray, tail: np.ndarray, n: int) -> tuple[int, int]:
    """``(sum w_k, sum k*w_k)`` mod 2**64 of n words (k from 1) seen as a
    matrix of ``len(rows)`` rows of C words (k = r*C + c + 1) then ``tail``,
    from the matrix's row and column sums."""
    C, R = cols.size, rows.size
    s = int(rows.sum()) + int(tail.sum())
    t = (
        C * int((rows * np.arange(R, dtype=np.uint64)).sum())
        + int((cols * np.arange(1, C + 1, dtype=np.uint64)).sum())
        + int((tail * np.arange(R * C + 1, n + 1, dtype=np.uint64)).sum())
    )
    return s & _MASK, t & _MASK


def _sums4(words: np.ndarray) -> tuple[int, int, int, int]:
    """``S, T, S', T'`` of uint64 words in one pass: each block of rows is
    summed along both axes, and again after shifting it (in cache)."""
    C = _COLUMNS
    R = words.size // C
    if R == 0:  # under a row: the weighted sums directly
        k = np.arange(1, words.size + 1, dtype=np.uint64)
        upper = words >> np.uint64(32)
        return tuple(int(v) for v in (words.sum(), words @ k, upper.sum(), upper @ k))
    full = words[: R * C].reshape(R, C)
    rows, upper_rows = np.empty(R, np.uint64), np.empty(R, np.uint64)
    cols, upper_cols = np.zeros(C, np.uint64), np.zeros(C, np.uint64)
    upper = np.empty((min(R, _BLOCK_ROWS), C), np.uint64)
    for r in range(0, R, _BLOCK_ROWS):  # numpy's integer sums wrap mod 2**64
        block = full[r : r + _BLOCK_ROWS]
        half = np.right_shift(block, np.uint64(32), out=upper[: block.shape[0]])
        np.add.reduce(block, axis=1, out=rows[r : r + _BLOCK_ROWS])
        cols += np.add.reduce(block, axis=0)
        np.add.reduce(half, axis=1, out=upper_rows[r : r + _BLOCK_ROWS])
        upper_cols += np.add.reduce(half, axis=0)
    tail = words[R * C :]
    s, t = _position_sums(rows, cols, tail, words.size)
    sh, th = _position_sums(upper_rows, upper_cols, tail >> np.uint64(32), words.size)
    return s, t, sh, th


def wsum64(array) -> str:
    """The ``wsum64-v1`` checksum of an array's bytes in C order: ``S, T, S',
    T'`` (see the module's docstring) as 64 hex digits."""
    data = _bytes(array)
    whole = data.size // 8 * 8
    words = data[:whole].view("<u8")
    if whole < data.size:  # the last word, zero-padded
        last = np.zeros(8, np.uint8)
        last[: data.size - whole] = data[whole:]
        words = np.concatenate([words, last.view("<u8")])
    if words.dtype != np.uint64:  # a big-endian host: the same numbers
        words = words.astype(np.uint64)
    return "".join(f"{v:016x}" for v in _sums4(words))


def xxh3_128(array) -> str:
    """The ``xxh3-128-v1`` checksum of an array's bytes in C order (little-endian):
    XXH3's 128-bit hash as 32 hex digits."""
    import xxhash

    data = np.ascontiguousarray(array)
    if data.dtype.byteorder == ">" or (data.dtype.byteorder == "=" and sys.byteorder == "big"):
        data = data.astype(data.dtype.newbyteorder("<"))
    return xxhash.xxh3_128_hexdigest(data.reshape(-1).view(np.uint8))


ALGORITHMS = {ALGORITHM: xxh3_128, "wsum64-v1": wsum64, "crc32": crc32}


def checksum(array, algorithm: str = ALGORITHM):
    """The checksum of an array's bytes in C order, by ``algorithm``."""
    return ALGORITHMS[algorithm](array)


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


def _key_name(key) -> str:
    """A key path entry as Orbax names it (``orbax`` ``get_key_name``)."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def path_name(path) -> str:
    """A tree path as Dew names an array in messages, ``'opt_state/0/mu/w'``."""
    return "/".join(_key_name(k) for k in path)


def _named_leaves(tree) -> list[tuple[str, Any]]:
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


# Threads sharing the sums of a restore (xxhash, numpy and zlib release the GIL).
# One: XXH3 sums the medium state's 52 MB in 1.4 ms of one core, and a pool of 2
# threads only added its start-up (tools/bench_checkpoints.py on 2 shared cores:
# restore 1.18x the time without sums on 2 threads, 0.95x on 1; docs/performance.md).
# A save computes its sums on Orbax's commit thread alone: they are background work.
WORKERS = 1


def _sums(items: list[tuple[str, np.ndarray]], workers: int) -> list:
    """The checksum of each ``(algorithm, data)``, on ``workers`` threads."""
    if workers == 1 or len(items) < 2:
        return [checksum(data, algorithm) for algorithm, data in items]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda item: checksum(item[1], item[0]), items))


def record(shards: list[tuple[str, str, np.ndarray]]) -> dict:
    """The JSON record of this process's shards."""
    arrays: dict[str, dict[str, str]] = {}
    sums = _sums([(ALGORITHM, data) for _, _, data in shards], workers=1)
    for (name, key, _), value in zip(shards, sums, strict=True):
        arrays.setdefault(name, {})[key] = value
    return {"algorithm": ALGORITHM, "arrays": arrays}


def _filename() -> str:
    return f"process_{jax.process_index()}-of-{jax.process_count()}.json"


def read_recorded(
    path: str, *, format: int | None = None
) -> dict[str, dict[str, tuple[str, Any]]] | None:
    """Every process's recorded sums of the checkpoint at ``path``, merged,
    ``{array: {shard index: (algorithm, sum)}}``; None for a checkpoint
    written without them, before they existed (``format``, its meta's, below
    :data:`WITH_CHECKSUMS`, or not given). A checkpoint of a format that records
    them and has none raises :class:`ChecksumsMissingError`."""
    directory = os.path.join(path, ITEM)
    if not os.path.isdir(directory):
        if format is not None and format >= WITH_CHECKSUMS:
            raise ChecksumsMissingError(path, format)
        return None
    merged: dict[str, dict[str, tuple[str, Any]]] = {}
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("process_") and name.endswith(".json")):
            continue
        with open(os.path.join(directory, name)) as f:
            content = json.load(f)
        algorithm = content.get("algorithm")
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"checkpoint {path}: {ITEM}/{name} uses checksum {algorithm!r}, which this "
                f"version of Dew does not know (it knows {sorted(ALGORITHMS)}); resume with "
                f"the Dew version that wrote it"
            )
        for array, shards in content["arrays"].items():
            entry = merged.setdefault(array, {})
            entry.update((key, (algorithm, value)) for key, value in shards.items())
    return merged


def verify(tree, recorded: dict[str, dict[str, tuple[str, Any]]]) -> int:
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
        for key, (algorithm, value) in saved.items():
            if key in local:
                data = np.asarray(local[key])
            elif not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
                whole = np.asarray(leaf) if whole is None else whole  # another layout
                data = whole[_slices(key)]
            else:
                continue  # another process holds it
            checked.append((name, key, algorithm, value, data))
    sums = _sums([(algorithm, data) for _, _, algorithm, _, data in checked], WORKERS)
    for (name, key, algorithm, value, _), got in zip(checked, sums, strict=True):
        if got != value:
            mismatch = ChecksumMismatchError(name, key, value, got, algorithm)
            break
    if mismatch is not None:
        raise mismatch
    return len(checked)


def _handler_classes():
    """The Orbax handler and its save/restore args, defined on first use (Orbax
    is imported only by runs that checkpoint)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import orbax.checkpoint as ocp

    from dew.train._compat import orbax_async_handler

    async_handler, commit_future = orbax_async_handler()

    class ChecksumsHandler(async_handler):
        """Writes this process's record; the sums are computed in the commit
        thread, before the checkpoint commits."""

        async def _write(self, args, directory):
            # on this commit future's own thread: wait until ``save`` has
            # returned, so that the sums do not take cores from its foreground
            # work (what a training step waits for)
            args.started.wait(timeout=_RELEASE_TIMEOUT_S)
            content = json.dumps(record(args.shards), indent=0)
            (directory / _filename()).write_text(content)

        async def async_save(self, directory, args):
            return [commit_future(self._write(args, directory), name="dew_checksums_save")]

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
        started: threading.Event  # set when the save has returned (CheckpointSession.save)

    @ocp.args.register_with_handler(ChecksumsHandler, for_restore=True)
    @dataclasses.dataclass
    class ChecksumsRestore(ocp.args.CheckpointArgs):
        pass

    _CLASSES = (ChecksumsHandler, ChecksumsSave, ChecksumsRestore)
    return _CLASSES


_CLASSES = None


_RELEASE_TIMEOUT_S = 60.0  # a save that never says it returned: sum anyway


def save_args(tree, *, deferred: bool = False):
    """The Orbax args that write ``tree``'s checksums as the ``checksums`` item.

    deferred: an asynchronous save computes the sums only once its caller sets
      the args' ``started`` event (after Orbax's ``save`` returns; the caller
      must set it, also when the save fails); otherwise at once.
    """
    started = threading.Event()
    if not deferred:
        started.set()
    return _handler_classes()[1](host_shards(tree), started)
