"""A corpus tokenized once into a memory-mapped file, keyed by its inputs and tokenizer.

The cache is two files in ``cache_dir``: ``<key>.tokens`` (the ids, raw,
uint16 when the vocabulary fits, else uint32) and ``<key>.json`` (dtype,
counts, what went in). The key hashes the sources (path, size and mtime of
each file, or a ``datasets`` fingerprint), the field read, the tokenizer's
``fingerprint()`` and the end id, so changing any of them tokenizes again.
Both files are written under temporary names and renamed, the JSON last: a
cache is either complete or absent, and processes that race write the same
bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np

from dew.data.tokenizers import ByteTokenizer

FORMAT = 1
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


def tokenize_cached(
    documents: Iterable[str], *, key_parts: dict, tokenizer, end_id: int, cache_dir: str
) -> tuple[np.memmap, dict]:
    """The token ids of ``documents`` (each followed by ``end_id``), memory-mapped.

    documents: iterated only when the cache is missing.
    Returns ``(ids, meta)``; ``meta`` holds ``tokens`` (all ids, end ids included),
    ``documents`` and ``text_tokens`` (ids that are not end ids).
    """
    os.makedirs(cache_dir, exist_ok=True)
    key = cache_key({**key_parts, "tokenizer": tokenizer.fingerprint(), "end_id": end_id})
    data_file = os.path.join(cache_dir, key + ".tokens")
    meta_file = os.path.join(cache_dir, key + ".json")
    if not (os.path.exists(meta_file) and os.path.exists(data_file)):
        dtype = np.uint16 if tokenizer.vocab_size <= 2**16 and end_id < 2**16 else np.uint32
        limit = np.iinfo(dtype).max
        end = np.asarray([end_id], dtype)
        tokens = text_tokens = count = 0
        fd, tmp_data = tempfile.mkstemp(dir=cache_dir, suffix=".tokens.tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in _encode_chunks(tokenizer, documents):
                    for ids in chunk:
                        if ids.size and int(ids.max()) > limit:
                            raise ValueError(
                                f"token id {int(ids.max())} does not fit the cache dtype "
                                f"{np.dtype(dtype).name}; the tokenizer's vocab_size "
                                f"{tokenizer.vocab_size} is too small for its own ids"
                            )
                        out.write(ids.astype(dtype, copy=False).tobytes())
                        out.write(end.tobytes())
                        text_tokens += ids.size
                        tokens += ids.size + 1
                        count += 1
            meta = {
                "format": FORMAT,
                "dtype": np.dtype(dtype).name,
                "tokens": tokens,
                "text_tokens": text_tokens,
                "documents": count,
                "end_id": end_id,
                "sources": key_parts,
            }
            os.replace(tmp_data, data_file)
        except BaseException:
            if os.path.exists(tmp_data):
                os.remove(tmp_data)
            raise
        fd, tmp_meta = tempfile.mkstemp(dir=cache_dir, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1, default=str)
        os.replace(tmp_meta, meta_file)
    with open(meta_file) as f:
        meta = json.load(f)
    if meta["tokens"] == 0:
        ids = np.zeros((0,), meta["dtype"])
    else:
        ids = np.memmap(data_file, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
    return ids, meta
