"""``ParquetStream``: the parquet shards of a Hugging Face ``datasets`` repository,
streamed row group by row group into windows of token ids.

:class:`dew.data.TokenWindows` reads the same files (a directory of ``.parquet``
files, column ``field``), but it tokenizes the whole corpus into its cache before
the first batch and then addresses every window at random (a global shuffle).
``ParquetStream`` never passes over the whole set: it reads one row group of one
shard at a time (``pyarrow.parquet.ParquetFile.read_row_group``, the text column
only), tokenizes its rows as they come and cuts the joined stream into windows,
so the first batch is ready after one row group and nothing is written to disk.

Order and shares: the unit of reading is a row group. Epoch ``e`` visits the row
groups of every shard in a permutation drawn from ``(seed, e)`` (in file order
with ``shuffle=False``), and process ``p`` of ``count`` reads positions ``p, p +
count, ...`` of it: it opens only its own row groups. Each process cuts its own
stream into windows (``batch / count`` a step), so, as with every streaming
reader, the processes' shares are not one process's batch cut in pieces.

Position: the training iterator's ``get_state()`` is where the next window
starts, ``{"epoch", "unit", "row", "offset"}`` (the row group's place in this
process's order, the row in it, the id in that row's document), plus the
partition and the count of row groups; ``set_state`` re-reads that one row group
and skips to the id, so a resume is exact and instant. A position saved for
another partition or another set of shards is an error.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dew.data._cache import _encode_chunks
from dew.data._corpus import expand_paths
from dew.data._extra import hf_import
from dew.data.dataset import Batch, Dataset, Field, Partition
from dew.data.tokenizers import ByteTokenizer


def split_files(path: Any, split: str | None, *, what: str) -> list[str]:
    """The parquet files of ``split`` in a ``datasets`` repository on disk.

    A directory is searched (recursively) for ``<split>-*.parquet`` files and for
    the ``.parquet`` files of a ``<split>/`` folder (the two layouts of the Hub's
    parquet exports); ``split=None`` takes every ``.parquet`` file. Files, lists and
    glob patterns are taken as given."""
    if isinstance(path, str | os.PathLike) and os.path.isdir(path):
        root = os.fspath(path)
        every = sorted(glob.glob(os.path.join(root, "**", "*.parquet"), recursive=True))
        if not every:
            raise FileNotFoundError(f"{what}: the directory {root!r} holds no .parquet file")
        if split is None:
            return every
        chosen = [
            f
            for f in every
            if os.path.basename(f).startswith(f"{split}-")
            or split in os.path.relpath(f, root).split(os.sep)[:-1]
        ]
        if not chosen:
            shown = [os.path.relpath(f, root) for f in every[:8]]
            raise FileNotFoundError(
                f"{what}: no parquet file of split {split!r} in {root!r} (looked for "
                f"{split}-*.parquet and {split}/*.parquet); its parquet files are {shown}"
                f"{' ...' if len(every) > 8 else ''}; set split= to one of them, or None"
            )
        return chosen
    return expand_paths(path, (".parquet",), what=what)


@dataclasses.dataclass(frozen=True)
class ParquetStream:
    """Parquet shards streamed into windows of ``seq_len + 1`` token ids.

    Each row's ``field`` is a document, followed by the end id; the documents are
    joined into one stream per process and cut as :class:`TokenWindows` cuts its
    stream (window ``i`` is ids ``i * seq_len ... i * seq_len + seq_len``).
    Batches hold ``"text"``: int32 ``[rows, seq_len + 1]``, the spec of
    ``TokenWindows``. See the module's text for the order, the shares and the
    position. Training is endless (epochs repeat); there is no validation set
    (validate with a ``TokenWindows`` of held-out files), and it is not a
    :class:`Mixture` source (a mixture addresses rows at random).

    path: a ``datasets`` repository on disk (a directory; ``split`` chooses its
      files), or parquet files, directories or glob patterns.
    seq_len: positions the model sees; a window has ``seq_len + 1`` ids.
    split: the split whose files are read from a directory (``train`` reads
      ``data/train-00000-of-00004.parquet``, ...); None = every parquet file.
    field: the column holding the text.
    tokenizer: anything with ``encode`` (or ``encode_batch``) and ``end_id``.
    seed: the permutation of row groups of each epoch.
    shuffle: False = row groups in file order every epoch.
    end_id: the id after each document; None = ``tokenizer.end_id``.
    """

    path: Any
    seq_len: int
    _: dataclasses.KW_ONLY
    split: str | None = "train"
    field: str = "text"
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    seed: int = 0
    shuffle: bool = True
    end_id: int | None = None

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"ParquetStream.seq_len must be >= 1 positions, got {self.seq_len}")
        if self.end_id is None and getattr(self.tokenizer, "end_id", None) is None:
            raise ValueError(
                "the tokenizer has no end id (no eos_token in its tokenizer_config.json); "
                "pass end_id= to ParquetStream"
            )

    def files(self) -> list[str]:
        """The parquet files read, in order."""
        return split_files(self.path, self.split, what="ParquetStream")

    def units(self) -> list[tuple[str, int]]:
        """Every ``(file, row group)`` of the files, in file order (only footers are read).

        A file without column ``field`` is an error listing its columns."""
        pq = hf_import("pyarrow.parquet", needed_by="ParquetStream")
        units = []
        for path in self.files():
            metadata = pq.ParquetFile(path).metadata
            names = metadata.schema.to_arrow_schema().names
            if self.field not in names:
                raise KeyError(
                    f"ParquetStream: {path} has no column {self.field!r}; its columns are "
                    f"{names}; set field= to the one holding the text"
                )
            units.extend((path, group) for group in range(metadata.num_row_groups))
        if not units:
            raise ValueError(f"ParquetStream: the files of {self.path!r} hold no row group")
        return units

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` windows per global batch, streamed."""
        units = self.units()
        spec = {"text": Field((self.seq_len + 1,), np.int32)}

        def open_train(partition: Partition) -> StreamIterator:
            rows = partition.rows(batch)
            if partition.count > len(units):
                raise ValueError(
                    f"ParquetStream: {len(units)} row groups cannot give each of "
                    f"{partition.count} processes a share; write the shards with smaller "
                    f"row groups or use fewer processes"
                )
            return StreamIterator(self, units, partition, rows)

        return Dataset(train=open_train, val=None, records=0, batch=batch, spec=spec)


class StreamIterator:
    """Batches of one process's windows; ``get_state``/``set_state`` save its position."""

    def __init__(self, reader: ParquetStream, units, partition: Partition, rows: int):
        self._reader = reader
        self._units = units
        self._partition = partition
        self._rows = rows
        self._end_id = reader.end_id if reader.end_id is not None else reader.tokenizer.end_id
        self._start({"epoch": 0, "unit": 0, "row": 0, "offset": 0})

    def _order(self, epoch: int) -> list[tuple[str, int]]:
        order = np.arange(len(self._units))
        if self._reader.shuffle:
            order = np.random.default_rng([self._reader.seed, epoch]).permutation(order)
        return [self._units[i] for i in order[self._partition.index :: self._partition.count]]

    def _documents(self, first: int, unit: int, row: int) -> Iterator[tuple[dict, np.ndarray]]:
        """(position, ids with the end id) of each document from the given one on, endlessly."""
        pq = hf_import("pyarrow.parquet", needed_by="ParquetStream")
        field = self._reader.field
        for epoch in itertools.count(first):
            order = self._order(epoch)
            for index in range(unit, len(order)):
                path, group = order[index]
                column = pq.ParquetFile(path).read_row_group(group, columns=[field])
                texts = [t or "" for t in column.column(field).to_pylist()]
                del column  # only this row group's text is held, as Python strings
                for t in texts:
                    if not isinstance(t, str):
                        raise TypeError(
                            f"ParquetStream: {path}: column {field!r} holds "
                            f"{type(t).__name__}, not text"
                        )
                encoded = itertools.chain.from_iterable(
                    _encode_chunks(self._reader.tokenizer, texts[row:])
                )
                for number, ids in enumerate(encoded, start=row):
                    position = {"epoch": epoch, "unit": index, "row": number}
                    yield position, np.append(np.asarray(ids, np.int64), self._end_id)
                row = 0
            unit = 0

    def _start(self, state: dict) -> None:
        self._stream = self._documents(state["epoch"], state["unit"], state["row"])
        position, ids = next(self._stream)
        self._pending = [(position, ids[state["offset"] :], state["offset"])]

    def _window(self) -> np.ndarray:
        length = self._reader.seq_len + 1
        while sum(len(ids) for _, ids, _ in self._pending) < length:
            position, ids = next(self._stream)
            self._pending.append((position, ids, 0))
        window = np.concatenate([ids for _, ids, _ in self._pending])[:length]
        drop = self._reader.seq_len  # neighbours share one id
        while drop:
            position, ids, offset = self._pending[0]
            if len(ids) > drop:
                self._pending[0] = (position, ids[drop:], offset + drop)
                drop = 0
            else:
                drop -= len(ids)
                self._pending.pop(0)
        return window.astype(np.int32)

    def __iter__(self) -> StreamIterator:
        return self

    def __next__(self) -> Batch:
        return {"text": np.stack([self._window() for _ in range(self._rows)])}

    def get_state(self) -> dict:
        if not self._pending:
            self._pending.append((*next(self._stream), 0))
        position, _, offset = self._pending[0]
        return {
            **position,
            "offset": offset,
            "partition": [self._partition.index, self._partition.count],
            "row_groups": len(self._units),
        }

    def set_state(self, state: dict) -> None:
        saved = (list(state.get("partition", [])), state.get("row_groups"))
        here = ([self._partition.index, self._partition.count], len(self._units))
        if saved != here:
            raise ValueError(
                f"ParquetStream: the saved position is of partition {saved[0]} over "
                f"{saved[1]} row groups, this run reads partition {here[0]} over {here[1]}; "
                f"resume with the same shards and processes"
            )
        self._start(state)
