"""``TokenWindows``: a text corpus as shuffled windows of token ids, for language models."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import numpy as np

from dew.data._cache import SHARD_TOKENS, TokenIds, default_cache_dir, tokenize_cached
from dew.data._corpus import TEXT_SUFFIXES, expand_paths, is_hf_dataset, signature, texts
from dew.data._document_windows import LONG_DOCUMENTS, DocumentWindows
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.tokenizers import ByteTokenizer

DOCUMENTS = ("stream", "pack")


class _WindowFormat:
    """Window ``w`` of a stream of ids: ids ``w * seq_len ... w * seq_len + seq_len``."""

    def __init__(self, ids: TokenIds, seq_len: int):
        self._ids = ids
        self._seq_len = seq_len
        self.count = (ids.shape[0] - 1) // seq_len  # windows that fit
        self.spec = {"text": Field((seq_len + 1,), np.int32)}

    def example(self, window: int) -> dict[str, np.ndarray]:
        start = window * self._seq_len
        return {"text": np.asarray(self._ids[start : start + self._seq_len + 1], np.int32)}

    def examples(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        """Windows ``windows`` in one gather: int32 ``[len(windows), seq_len + 1]``."""
        positions = (windows * self._seq_len)[:, None] + np.arange(self._seq_len + 1)
        return {"text": np.asarray(self._ids[positions], np.int32)}


@dataclasses.dataclass(frozen=True)
class TokenWindows:
    """Text, tokenized once, cut into windows of ``seq_len + 1`` ids.

    Each document is followed by the end id, and the documents are joined
    into one stream of ids. Window ``i`` is ids ``i * seq_len ... i * seq_len
    + seq_len`` (neighbours share one id, so every id is a target once).
    Batches hold ``"text"``: int32 ``[rows, seq_len + 1]`` (the spec,
    ``{"text": Field((seq_len + 1,), "int32")}``).

    With ``documents="pack"`` windows hold whole documents instead (see
    ``dew.data._document_windows``): each window takes the next documents of the
    corpus while they fit and is padded with the end id, and batches also hold
    ``"segment_ids"`` (1, 2, ... per document of a row, 0 on padding) and
    ``"positions"`` (from 0 in each document), all int32 ``[rows, seq_len + 1]``.
    ``LMObjective(model, segment_ids_key="segment_ids", positions_key="positions")``
    then attends within a document only, restarts positions at each, and counts
    no target across documents or on padding.

    The validation set is, by default, the last ``val_fraction`` of the
    windows, in order: the end of the corpus (of the last file, for several
    files). ``val_from="head"`` takes the first windows instead, and
    ``val_paths`` validates on a separate corpus (all of its windows) and
    trains on every window of ``paths``.

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
      at least one window when above 0; 0 = no validation set. Not used with
      ``val_paths``.
    val_from: where the held-out windows are taken: ``"tail"`` (the end of the
      corpus) or ``"head"`` (its start).
    val_paths: a separate validation corpus (the same kinds of source as
      ``paths``), tokenized and cut the same way; None = hold out
      ``val_fraction`` of ``paths``.
    end_id: the id put after each document; None = ``tokenizer.end_id``.
    cache_dir: where the tokenized corpus is kept; None = ``$DEW_CACHE_DIR/tokens``
      or ``~/.cache/dew/tokens``.
    shard_tokens: ids per shard of the cache (a shard ends after the document
      that fills it): reading maps at most 4 shards at a time, so resident memory
      stays under about ``4 * shard_tokens`` ids whatever the corpus size, and an
      interrupted tokenization resumes after its last whole shard.
    documents: ``"stream"`` (windows cut from the joined stream, crossing
      documents; the default) or ``"pack"`` (whole documents per window, with
      segment ids and positions).
    long_documents: with ``documents="pack"``, a document longer than a window:
      ``"error"`` (the default, naming it), ``"split"`` (cut into windows, each
      piece its own segment) or ``"drop"`` (left out).
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
    val_from: str = "tail"
    val_paths: Any = None
    end_id: int | None = None
    cache_dir: str | os.PathLike | None = None
    shard_tokens: int = SHARD_TOKENS
    documents: str = "stream"
    long_documents: str = "error"
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"TokenWindows.seq_len must be >= 1 positions, got {self.seq_len}")
        check_split("TokenWindows", self.val_fraction, self.val_from)
        if self.documents not in DOCUMENTS:
            raise ValueError(
                f"TokenWindows.documents must be one of {DOCUMENTS} (windows cut from the "
                f"joined stream, or whole documents packed with segment ids), got "
                f"{self.documents!r}"
            )
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(
                f"TokenWindows.long_documents must be one of {LONG_DOCUMENTS}, got "
                f"{self.long_documents!r}"
            )
        if self.shard_tokens < 1:
            raise ValueError(f"TokenWindows.shard_tokens must be >= 1 ids, got {self.shard_tokens}")
        if self.end_id is None and getattr(self.tokenizer, "end_id", None) is None:
            raise ValueError(
                "the tokenizer has no end id (no eos_token in its tokenizer_config.json); "
                "pass end_id= to TokenWindows"
            )

    @property
    def document_end_id(self) -> int:
        """The id that follows each document."""
        return self.tokenizer.end_id if self.end_id is None else self.end_id

    def tokens(self) -> TokenIds:
        """All ids of the corpus (end ids included), read from the cache's shards."""
        return self._tokens(self.paths, "TokenWindows")

    def val_tokens(self) -> TokenIds | None:
        """All ids of ``val_paths`` (None without one), read from the cache's shards."""
        if self.val_paths is None:
            return None
        return self._tokens(self.val_paths, "TokenWindows (val_paths)")

    def _tokens(self, paths: Any, what: str) -> TokenIds:
        if is_hf_dataset(paths):
            dataset = paths
            if self.field not in dataset.column_names:
                raise KeyError(
                    f"{what}: the dataset has no column {self.field!r}; "
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
            files = expand_paths(paths, TEXT_SUFFIXES, what=what)
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
            shard_tokens=self.shard_tokens,
            what=what,
        )
        if meta["text_tokens"] == 0:
            raise ValueError(f"{what}: the corpus {described} is empty (no text)")
        return ids

    def _windows(self, ids: TokenIds, what: str) -> _WindowFormat | DocumentWindows:
        if self.documents == "pack":
            windows = DocumentWindows(
                ids,
                ids.document_ends(),
                self.seq_len,
                long_documents=self.long_documents,
                pad_id=self.document_end_id,
            )
            if windows.count == 0:
                raise ValueError(
                    f"{what}: long_documents='drop' left no document of at most seq_len + 1 "
                    f"= {self.seq_len + 1} ids; use a larger seq_len or long_documents='split'"
                )
            return windows
        if ids.shape[0] < self.seq_len + 1:
            raise ValueError(
                f"{what}: the corpus has {ids.shape[0]} tokens (end ids included), fewer than "
                f"one window of seq_len + 1 = {self.seq_len + 1}; use a smaller seq_len or "
                f"more text"
            )
        return _WindowFormat(ids, self.seq_len)

    def splits(self) -> tuple[Rows, Rows]:
        """The training and validation windows, as rows (what ``dew.data.Mixture`` reads)."""
        windows = self._windows(self.tokens(), "TokenWindows")
        if self.val_paths is not None:
            val_windows = self._windows(self.val_tokens(), "TokenWindows (val_paths)")
            train = Rows(windows, np.arange(windows.count))
            val = Rows(val_windows, np.arange(val_windows.count))
        else:
            train_rows, val_rows = split_rows(
                windows.count,
                val_fraction=self.val_fraction,
                val_from=self.val_from,
                what=f"TokenWindows ({windows.count} windows of {self.seq_len + 1} tokens)",
            )
            train, val = Rows(windows, train_rows), Rows(windows, val_rows)
        return train, val

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` windows per global batch (see ``dew.data.records``)."""
        return compose(*self.splits(), batch=batch, reader=self, name="TokenWindows")
