"""A corpus tokenized once into shards of ids, read through memory maps.

The cache of a corpus is a directory ``cache_dir/<key>``: shards
``shard-00000.tokens`` (the ids, raw, uint16 when the vocabulary fits, else
uint32), each with ``shard-00000.ends.npy`` (where each of its documents ends,
int64), ``progress.json`` (the shards written so far) and ``meta.json`` (dtype,
counts, what went in; written last, so a cache with it is complete). The key
hashes the sources (path, size and mtime of each file, or a ``datasets``
fingerprint), the field read, the tokenizer's ``fingerprint()`` and the end id,
so changing any of them tokenizes again.

Tokenizing writes whole documents into a shard until it holds ``shard_tokens``
ids, then renames it into place and records it in ``progress.json``, logging
the progress on the ``dew.data`` logger. An interrupted run leaves the finished
shards; the next one skips the documents they hold and tokenizes the rest.
Every file is written under a temporary name and renamed, so processes that
race write the same bytes.

Reading (:class:`TokenIds`) maps at most ``OPEN_SHARDS`` shards at a time and
unmaps the least recently read one beyond that, so the resident memory a
corpus costs is bounded by ``OPEN_SHARDS * shard_tokens`` ids whatever its size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from dew.data.tokenizers import ByteTokenizer

logger = logging.getLogger("dew.data")

FORMAT = 2
SHARD_TOKENS = 2**26  # ids per shard by default (128 MiB of uint16)
OPEN_SHARDS = 4  # shards mapped at once when reading
_DOCUMENTS_PER_CHUNK = 512


def default_cache_dir() -> str:
    """``$DEW_CACHE_DIR/tokens``, else ``$XDG_CACHE_HOME/dew/tokens``, else
    ``~/.cache/dew/tokens``."""
    if "DEW_CACHE_DIR" in os.environ:
        return os.path.join(os.environ["DEW_CACHE_DIR"], "tokens")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dew", "tokens")


def cache_key(parts: dict) -> str:
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _encode_chunks(tokenizer, documents: Iterable[str]) -> Iterator[list[np.ndarray]]:
    """Documents encoded in chunks; the byte tokenizer takes a fast path."""
    is_bytes = isinstance(tokenizer, ByteTokenizer)
    chunk: list[str] = []

    def encode(texts: list[str]) -> list[np.ndarray]:
        if is_bytes:
            return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        if hasattr(tokenizer, "encode_batch"):
            return [np.asarray(ids, np.int64) for ids in tokenizer.encode_batch(texts)]
        return [np.asarray(tokenizer.encode(t), np.int64) for t in texts]

    for text in documents:
        chunk.append(text)
        if len(chunk) == _DOCUMENTS_PER_CHUNK:
            yield encode(chunk)
            chunk = []
    if chunk:
        yield encode(chunk)


def _write_atomic(path: str, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it to ``path``."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_json(path: str, value: Any) -> None:
    _write_atomic(path, lambda f: f.write(json.dumps(value, indent=1, default=str).encode()))


def tokenize_cached(
    documents: Iterable[str],
    *,
    key_parts: dict,
    tokenizer,
    end_id: int,
    cache_dir: str,
    shard_tokens: int = SHARD_TOKENS,
    what: str = "TokenWindows",
) -> tuple[TokenIds, dict]:
    """The token ids of ``documents`` (each followed by ``end_id``), read through
    memory maps; tokenized into ``cache_dir`` first when not there (or resumed).

    documents: iterated only when the cache is missing or incomplete.
    shard_tokens: ids per shard, at least (a shard ends after the document that
      fills it).
    Returns ``(ids, meta)``; ``meta`` holds ``tokens`` (all ids, end ids included),
    ``documents``, ``text_tokens`` (ids that are not end ids) and ``shards``.
    """
    key = cache_key({**key_parts, "tokenizer": tokenizer.fingerprint(), "end_id": end_id})
    directory = os.path.join(cache_dir, key)
    meta_file = os.path.join(directory, "meta.json")
    if not os.path.exists(meta_file):
        os.makedirs(directory, exist_ok=True)
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 and end_id < 2**16 else np.uint32
        shards = _tokenize(
            documents,
            directory=directory,
            tokenizer=tokenizer,
            end_id=end_id,
            dtype=np.dtype(dtype),
            shard_tokens=shard_tokens,
            what=what,
        )
        meta = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "tokens": sum(s["tokens"] for s in shards),
            "text_tokens": sum(s["tokens"] - s["documents"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "end_id": end_id,
            "shards": shards,
            "sources": key_parts,
        }
        _write_json(meta_file, meta)
    with open(meta_file) as f:
        meta = json.load(f)
    return TokenIds(directory, meta), meta


def _tokenize(documents, *, directory, tokenizer, end_id, dtype, shard_tokens, what) -> list:
    """Write the shards of ``documents`` not yet written; the list of every shard."""
    progress_file = os.path.join(directory, "progress.json")
    shards: list[dict] = []
    if os.path.exists(progress_file):
        with open(progress_file) as f:
            shards = json.load(f)["shards"]
    done = sum(s["documents"] for s in shards)
    if shards:
        logger.info(
            "%s: resuming tokenization after %d documents (%d shards already written in %s)",
            what,
            done,
            len(shards),
            directory,
        )
    limit = np.iinfo(dtype).max
    end = np.asarray([end_id], dtype)
    started, tokens_before = time.monotonic(), sum(s["tokens"] for s in shards)
    pending: list[np.ndarray] = []
    ends: list[int] = []

    def finish() -> None:
        index = len(shards)
        name = f"shard-{index:05d}"
        _write_atomic(
            os.path.join(directory, name + ".tokens"),
            lambda f: [f.write(piece.tobytes()) for piece in pending],
        )
        _write_atomic(
            os.path.join(directory, name + ".ends.npy"),
            lambda f: np.save(f, np.asarray(ends, np.int64)),
        )
        shards.append({"name": name, "tokens": ends[-1], "documents": len(ends)})
        _write_json(progress_file, {"shards": shards})
        total = sum(s["tokens"] for s in shards)
        seconds = max(time.monotonic() - started, 1e-9)
        logger.info(
            "%s: tokenized %d documents, %d ids in %d shards (%.0f ids/s)",
            what,
            sum(s["documents"] for s in shards),
            total,
            len(shards),
            (total - tokens_before) / seconds,
        )
        pending.clear()
        ends.clear()

    size = 0
    for chunk in _encode_chunks(tokenizer, itertools.islice(documents, done, None)):
        for ids in chunk:
            if ids.size and int(ids.max()) > limit:
                raise ValueError(
                    f"token id {int(ids.max())} does not fit the cache dtype "
                    f"{dtype.name}; the tokenizer's vocab_size {tokenizer.vocab_size} is too "
                    f"small for its own ids"
                )
            pending.append(ids.astype(dtype, copy=False))
            pending.append(end)
            size += ids.size + 1
            ends.append(size)
            if size >= shard_tokens:
                finish()
                size = 0
    if ends:
        finish()
    return shards


class TokenIds:
    """Every id of a cached corpus as one read-only array, read from its shards
    through memory maps (at most ``OPEN_SHARDS`` mapped at a time).

    ``ids[i]``, ``ids[a:b]`` and ``ids[positions]`` (an int array of any shape)
    read numpy arrays; ``numpy.asarray(ids)`` reads them all.
    """

    def __init__(self, directory: str, meta: dict):
        self._directory = directory
        self.dtype = np.dtype(meta["dtype"])
        self._shards = meta["shards"]
        sizes = [s["tokens"] for s in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.shape = (int(self._starts[-1]),)
        self._open: OrderedDict[int, np.memmap] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.shape[0]

    def _shard(self, index: int) -> np.memmap:
        with self._lock:
            shard = self._open.pop(index, None)
            if shard is None:
                shard = np.memmap(self.paths[index], dtype=self.dtype, mode="r")
            self._open[index] = shard
            while len(self._open) > OPEN_SHARDS:
                self._open.popitem(last=False)  # unmapped once the last reader lets go
            return shard

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        positions = np.asarray(index, np.int64)
        if len(self._shards) == 1:  # the common case: one gather, no bookkeeping
            return np.asarray(self._shard(0)[positions])
        flat = positions.reshape(-1)
        out = np.empty(flat.shape, self.dtype)
        shard_of = np.searchsorted(self._starts, flat, side="right") - 1
        for shard in np.unique(shard_of):
            chosen = shard_of == shard
            out[chosen] = self._shard(int(shard))[flat[chosen] - self._starts[shard]]
        return out.reshape(positions.shape)

    @property
    def paths(self) -> list[str]:
        """The shard files, in corpus order."""
        return [os.path.join(self._directory, s["name"] + ".tokens") for s in self._shards]

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def document_ends(self) -> np.ndarray:
        """Where each document ends (exclusive), in ids from the corpus start: int64."""
        ends = [
            np.load(os.path.join(self._directory, s["name"] + ".ends.npy")) + start
            for s, start in zip(self._shards, self._starts, strict=False)
        ]
        return np.concatenate([np.zeros(0, np.int64), *ends])
