"""A teacher's top-k log-probs, stored once, read back as a reader (offline distillation).

A large teacher runs over the training rows a single time
(``dew.objectives.language.teacher_topk.write_teacher_topk``); what it writes, through
:class:`TopKWriter`, is a directory of safetensors shards and an ``index.json``:

- per row, the columns of the rows it read (``text``, and ``loss_mask``,
  ``segment_ids``, ``positions`` where the rows had them), ``[seq_len + 1]`` each;
- ``teacher_topk_ids`` int32 ``[seq_len, k]``: at each position the teacher's k most
  likely next ids, most likely first;
- ``teacher_topk_logprobs`` float32 ``[seq_len, k]``: their log-probs at the
  temperature ``T`` of the index, normalised over the teacher's whole vocabulary;
- ``teacher_tail_logprob`` float32 ``[seq_len]``: the log of the probability mass
  of all the other ids (the tail), computed from the full logits, so a loss can
  use the ``k + 1`` categories (k ids + tail) without rounding ``1 - sum``.

:class:`TeacherTopK` reads them on Grain like every reader (``dew.data.records``):
shuffled anew each epoch, partitioned across processes, its position saved in
checkpoints. A shard is written whole to a temporary name and renamed, so a
stopped writer leaves only whole shards, and the index is written last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from dew.data._extra import install_hint
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.records import RecordError

INDEX = "index.json"
IDS, LOGPROBS, TAIL = "teacher_topk_ids", "teacher_topk_logprobs", "teacher_tail_logprob"


def _safetensors():
    try:
        import safetensors.numpy  # noqa: F401
        from safetensors import safe_open
    except ImportError as error:  # pragma: no cover - the [hf] extra
        raise ImportError(
            f"teacher top-k shards are safetensors files, and safetensors is not installed: "
            f"{install_hint('hf')}"
        ) from error
    return safetensors.numpy, safe_open


class TopKWriter:
    """Writes rows and their teacher top-k to ``path`` in shards of ``rows_per_shard``.

    path: a directory, created; one that already holds an index is refused (the
      cache of another run: remove it or use another directory).
    k: ids kept per position.
    temperature: the temperature the log-probs were computed at (> 0).
    vocab_size: the teacher's vocabulary, recorded for the checks of the reader.
    rows_per_shard: rows per safetensors file.
    metadata: more strings for the index (the teacher's source, say).

    ``add(batch)`` takes numpy arrays of ``rows`` rows (the row columns and the
    three teacher columns of the module docstring); ``close()`` writes the last
    shard and the index. Use it as a context manager.
    """

    def __init__(
        self,
        path,
        *,
        k: int,
        temperature: float,
        vocab_size: int,
        rows_per_shard: int = 1024,
        metadata: Mapping[str, str] | None = None,
    ):
        self.path = pathlib.Path(path)
        if (self.path / INDEX).exists():
            raise FileExistsError(
                f"{self.path} already holds a teacher top-k cache ({INDEX}); remove it or "
                f"write to another directory"
            )
        if k < 1 or rows_per_shard < 1 or not temperature > 0:
            raise ValueError(
                f"TopKWriter needs k >= 1, rows_per_shard >= 1 and temperature > 0; got "
                f"k={k}, rows_per_shard={rows_per_shard}, temperature={temperature}"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        self.k, self.temperature, self.vocab_size = int(k), float(temperature), int(vocab_size)
        self.rows_per_shard, self.metadata = int(rows_per_shard), dict(metadata or {})
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0
        self._shards: list[dict[str, Any]] = []
        self._spec: dict[str, tuple[tuple[int, ...], str]] | None = None

    def add(self, batch: Mapping[str, np.ndarray]) -> None:
        batch = {key: np.asarray(value) for key, value in batch.items()}
        spec = {key: (value.shape[1:], value.dtype.str) for key, value in batch.items()}
        if self._spec is None:
            missing = {"text", IDS, LOGPROBS, TAIL} - set(batch)
            if missing:
                raise KeyError(f"TopKWriter.add: the batch lacks {sorted(missing)}")
            if batch[IDS].shape[-1] != self.k:
                raise ValueError(
                    f"TopKWriter.add: {IDS} holds {batch[IDS].shape[-1]} ids per position, "
                    f"the writer's k is {self.k}"
                )
            self._spec = spec
        elif spec != self._spec:
            raise ValueError(
                f"TopKWriter.add: a batch of columns {spec} after batches of {self._spec}; "
                f"every batch must have the same columns and row shapes"
            )
        rows = len(batch["text"])
        at = 0
        while at < rows:
            take = min(rows - at, self.rows_per_shard - self._pending_rows)
            self._pending.append({key: value[at : at + take] for key, value in batch.items()})
            self._pending_rows += take
            at += take
            if self._pending_rows == self.rows_per_shard:
                self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        save, _ = _safetensors()
        name = f"shard-{len(self._shards):05d}.safetensors"
        tensors = {
            key: np.ascontiguousarray(np.concatenate([part[key] for part in self._pending]))
            for key in self._pending[0]
        }
        temporary = self.path / (name + ".tmp")
        save.save_file(tensors, temporary)
        os.replace(temporary, self.path / name)
        self._shards.append({"file": name, "rows": self._pending_rows})
        self._pending, self._pending_rows = [], 0

    def close(self) -> pathlib.Path:
        """Write the last shard and the index; returns the directory."""
        self._flush()
        if not self._shards:
            raise ValueError(f"TopKWriter: no rows were added to {self.path}")
        index = {
            "k": self.k,
            "temperature": self.temperature,
            "vocab_size": self.vocab_size,
            "shards": self._shards,
            "metadata": self.metadata,
        }
        temporary = self.path / (INDEX + ".tmp")
        temporary.write_text(json.dumps(index, indent=1))
        os.replace(temporary, self.path / INDEX)
        return self.path

    def __enter__(self) -> TopKWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()


class _TopKFormat:
    """Row ``r`` of the shards: found by the shards' row counts, read by slices."""

    def __init__(self, path: pathlib.Path, shards: list[dict[str, Any]]):
        _, self._open = _safetensors()
        self._files = [path / s["file"] for s in shards]
        self._starts = np.concatenate([[0], np.cumsum([s["rows"] for s in shards])])
        self.count = int(self._starts[-1])
        with self._open(self._files[0], framework="numpy") as f:
            self.spec = {}
            for key in f.keys():
                piece = f.get_slice(key)  # one row read, for its dtype
                self.spec[key] = Field(tuple(piece.get_shape()[1:]), piece[0:1].dtype)

    def examples(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        out = {key: np.empty((len(rows), *f.shape), f.dtype) for key, f in self.spec.items()}
        shard_of = np.searchsorted(self._starts, rows, side="right") - 1
        for shard in np.unique(shard_of):
            chosen = np.flatnonzero(shard_of == shard)
            local = rows[chosen] - self._starts[shard]
            try:
                with self._open(self._files[shard], framework="numpy") as f:
                    for key in self.spec:
                        piece = f.get_slice(key)
                        out[key][chosen] = np.stack([piece[int(r) : int(r) + 1][0] for r in local])
            except (OSError, ValueError, KeyError) as error:
                raise RecordError(
                    f"rows {local.tolist()} of {self._files[shard]}", str(error)
                ) from error
        return out

    def example(self, row: int) -> dict[str, np.ndarray]:
        return {key: value[0] for key, value in self.examples(np.asarray([row])).items()}


@dataclasses.dataclass(frozen=True)
class TeacherTopK:
    """The rows and teacher top-k a :class:`TopKWriter` stored, as a Grain reader.

    Batch keys: the stored row columns (``text``, ``loss_mask``, ...) and
    ``teacher_topk_ids``, ``teacher_topk_logprobs``, ``teacher_tail_logprob``
    (module docstring). ``DistillationObjective(..., stored_teacher=True,
    temperature=reader.temperature, text_key="text", ...)`` trains on them
    without running the teacher.

    path: the directory the writer closed.
    val_fraction, val_from, seed, read_threads, prefetch: as for
      :class:`dew.data.SFTExamples` (the held-out share is of the stored rows).
    """

    path: Any
    _: dataclasses.KW_ONLY
    val_fraction: float = 0.0
    val_from: str = "tail"
    seed: int = 0
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        check_split("TeacherTopK", self.val_fraction, self.val_from)

    @property
    def index(self) -> dict[str, Any]:
        """The writer's ``index.json``: ``k``, ``temperature``, ``vocab_size``, shards."""
        path = pathlib.Path(self.path) / INDEX
        if not path.exists():
            raise FileNotFoundError(
                f"{path} does not exist: {self.path} is not a closed teacher top-k cache "
                f"(write it with dew.objectives.language.teacher_topk.write_teacher_topk)"
            )
        return json.loads(path.read_text())

    @property
    def temperature(self) -> float:
        """The temperature the stored log-probs are at: the loss must use the same."""
        return float(self.index["temperature"])

    @property
    def k(self) -> int:
        return int(self.index["k"])

    def splits(self) -> tuple[Rows, Rows | None]:
        """The training and validation rows (what ``dew.data.Mixture`` reads)."""
        rows = _TopKFormat(pathlib.Path(self.path), self.index["shards"])
        train, val = split_rows(
            rows.count, val_fraction=self.val_fraction, val_from=self.val_from, what="TeacherTopK"
        )
        return Rows(rows, train), Rows(rows, val) if len(val) else None

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` stored rows per global batch."""
        return compose(*self.splits(), batch=batch, reader=self, name="TeacherTopK")
