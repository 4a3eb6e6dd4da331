"""``TokenWindows``: a text corpus as shuffled windows of token ids, for language models."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import numpy as np

from dew.data._cache import default_cache_dir, tokenize_cached
from dew.data._corpus import TEXT_SUFFIXES, expand_paths, is_hf_dataset, signature, texts
from dew.data.dataset import Dataset
from dew.data.records import from_records
from dew.data.tokenizers import ByteTokenizer


class _Windows:
    """Windows ``first .. first + count - 1`` of ``seq_len + 1`` ids, stride ``seq_len``."""

    def __init__(self, ids: np.ndarray, seq_len: int, first: int, count: int):
        self._ids = ids
        self._seq_len = seq_len
        self._first = first
        self._count = count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = (self._first + index) * self._seq_len
        return {"text": np.asarray(self._ids[start : start + self._seq_len + 1], np.int32)}

    def read_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Windows ``indices`` in one gather: int32 ``[len(indices), seq_len + 1]``."""
        starts = (self._first + np.asarray(indices)) * self._seq_len
        positions = starts[:, None] + np.arange(self._seq_len + 1)
        return {"text": np.asarray(self._ids[positions], np.int32)}


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Text, tokenized once, cut into windows of ``seq_len + 1`` ids.

    Each document is followed by the end id, and the documents are joined
    into one stream of ids. Window ``i`` is ids ``i * seq_len ... i * seq_len
    + seq_len`` (neighbours share one id, so every id is a target once); the
    last ``val_fraction`` of the windows (the end of the corpus) is the
    validation set. Batches hold ``"text"``: int32 ``[rows, seq_len + 1]``.

    paths: the corpus: a file, a directory, a glob pattern, a list of them, or
      a ``datasets.Dataset``. Files: ``.txt`` (the whole file is one
      document), ``.jsonl`` (``field`` of each line is a document), ``.parquet``
      (column ``field``; needs the ``[hf]`` extra).
    seq_len: positions the model sees; a window has ``seq_len + 1`` ids.
    tokenizer: anything with ``encode``, ``vocab_size`` and ``fingerprint()``
      (:class:`ByteTokenizer`, :class:`HFTokenizer`).
    seed: shuffle seed of the training windows (each epoch reshuffles).
    field: the JSON field, parquet column or dataset column holding the text.
    val_fraction: share of windows held out for validation, in ``[0, 1)``;
      at least one window when above 0; 0 = no validation set.
    end_id: the id put after each document; None = ``tokenizer.end_id``.
    cache_dir: where the tokenized corpus is kept; None = ``$DEW_CACHE_DIR/tokens``
      or ``~/.cache/dew/tokens``.
    read_threads: Grain threads reading ahead (0 = in the caller's thread).
    prefetch: batches read ahead.
    """

    paths: Any
    seq_len: int
    _: dataclasses.KW_ONLY
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    seed: int = 0
    field: str = "text"
    val_fraction: float = 0.05
    end_id: int | None = None
    cache_dir: str | os.PathLike | None = None
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"TokenWindows.seq_len must be >= 1 positions, got {self.seq_len}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(
                f"TokenWindows.val_fraction must be in [0, 1), got {self.val_fraction}"
            )
        if self.end_id is None and getattr(self.tokenizer, "end_id", None) is None:
            raise ValueError(
                "the tokenizer has no end id (no eos_token in its tokenizer_config.json); "
                "pass end_id= to TokenWindows"
            )

    @property
    def document_end_id(self) -> int:
        """The id that follows each document."""
        return self.tokenizer.end_id if self.end_id is None else self.end_id

    def tokens(self) -> np.ndarray:
        """All ids of the corpus (end ids included), memory-mapped from the cache."""
        if is_hf_dataset(self.paths):
            dataset = self.paths
            if self.field not in dataset.column_names:
                raise KeyError(
                    f"TokenWindows: the dataset has no column {self.field!r}; "
                    f"its columns are {list(dataset.column_names)}"
                )
            described = f"the datasets.Dataset {dataset._fingerprint}"
            key_parts = {"dataset": dataset._fingerprint, "field": self.field}
            documents = (
                text or ""
                for rows in dataset.select_columns([self.field]).iter(batch_size=1024)
                for text in rows[self.field]
            )
        else:
            files = expand_paths(self.paths, TEXT_SUFFIXES, what="TokenWindows")
            described = ", ".join(files[:3]) + (
                f" and {len(files) - 3} more files" if len(files) > 3 else ""
            )
            key_parts = {"files": [signature(f) for f in files], "field": self.field}
            documents = itertools.chain.from_iterable(texts(f, self.field) for f in files)
        cache_dir = os.fspath(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
        ids, meta = tokenize_cached(
            documents,
            key_parts=key_parts,
            tokenizer=self.tokenizer,
            end_id=self.document_end_id,
            cache_dir=cache_dir,
        )
        if meta["text_tokens"] == 0:
            raise ValueError(f"TokenWindows: the corpus {described} is empty (no text)")
        return ids

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` windows per global batch (see ``dew.data.records``)."""
        ids = self.tokens()
        window = self.seq_len + 1
        if ids.shape[0] < window:
            raise ValueError(
                f"TokenWindows: the corpus has {ids.shape[0]} tokens (end ids included), fewer "
                f"than one window of seq_len + 1 = {window}; use a smaller seq_len or more text"
            )
        windows = (ids.shape[0] - 1) // self.seq_len
        held_out = 0 if self.val_fraction == 0 else max(1, round(windows * self.val_fraction))
        if windows - held_out < 1:
            raise ValueError(
                f"TokenWindows: the corpus gives {windows} window(s) of {window} tokens and "
                f"val_fraction={self.val_fraction} holds out {held_out}, leaving none to train "
                f"on; use val_fraction=0, a smaller seq_len or more text"
            )
        train = _Windows(ids, self.seq_len, 0, windows - held_out)
        val = _Windows(ids, self.seq_len, windows - held_out, held_out) if held_out else None
        return from_records(
            train,
            val,
            batch=batch,
            seed=self.seed,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
            name="TokenWindows",
        )
