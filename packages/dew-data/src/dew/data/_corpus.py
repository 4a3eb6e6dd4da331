"""Local files of text and rows: path expansion, and reading .txt, .jsonl and parquet."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from dew.data._extra import hf_import

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
ROW_SUFFIXES = (".jsonl", ".parquet")


def is_hf_dataset(value: Any) -> bool:
    """Whether ``value`` is a ``datasets.Dataset`` (checked without importing ``datasets``)."""
    return type(value).__module__.startswith("datasets") and hasattr(value, "column_names")


def expand_paths(
    paths: str | os.PathLike | Sequence[str | os.PathLike], suffixes: tuple[str, ...], *, what: str
) -> list[str]:
    """Files named by ``paths``: files, directories (their files with ``suffixes``, sorted,
    recursively) and glob patterns. A missing path or a path that holds no such file is
    an error naming it."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    files: list[str] = []
    for entry in paths:
        path = os.fspath(entry)
        if any(ch in path for ch in "*?["):
            matches = sorted(glob.glob(path, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{what}: the pattern {path!r} matches no file")
            candidates = matches
        elif os.path.isdir(path):
            candidates = sorted(
                os.path.join(root, name) for root, _, names in os.walk(path) for name in names
            )
            candidates = [c for c in candidates if c.endswith(suffixes)]
            if not candidates:
                raise FileNotFoundError(
                    f"{what}: the directory {path!r} holds no {'/'.join(suffixes)} file"
                )
        elif os.path.exists(path):
            candidates = [path]
        else:
            raise FileNotFoundError(f"{what}: no such file or directory: {path!r}")
        for candidate in candidates:
            if not candidate.endswith(suffixes):
                raise ValueError(
                    f"{what}: cannot read {candidate!r}; supported files end in "
                    f"{', '.join(suffixes)}"
                )
            files.append(candidate)
    if not files:
        raise ValueError(f"{what}: no paths given")
    return files


def signature(path: str) -> list:
    """What identifies a file's contents for a cache: absolute path, size, mtime (ns)."""
    stat = os.stat(path)
    return [os.path.abspath(path), stat.st_size, stat.st_mtime_ns]


class MissingField(KeyError):
    """A row without a field; ``at``: how far the reading got, ``(file, line)`` (the
    file's index among those read, the line's number), so that of two readings of
    the same rows the one that read further can be told."""

    def __init__(self, message: str, at: tuple[int, int]):
        super().__init__(message)
        self.at = at


def _missing_field(
    path: str, where: str, field: str, present, at: tuple[int, int] = (0, 0)
) -> MissingField:
    return MissingField(
        f"{path}{where}: no field {field!r}; the fields there are {sorted(present)}", at
    )


def read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}, line {number}: expected a JSON object, got {type(row).__name__}"
                )
            yield number, row


def parquet_columns(path: str, fields: Sequence[str]) -> Iterator[dict[str, list]]:
    """Row groups of a parquet file as {field: values}; an unknown field is an error
    listing the file's columns."""
    pq = hf_import("pyarrow.parquet", needed_by=f"reading {path}")

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    for field in fields:
        if field not in names:
            raise KeyError(f"{path}: no column {field!r}; the columns are {names}")
    for record_batch in file.iter_batches(columns=list(fields), batch_size=4096):
        yield {field: record_batch.column(field).to_pylist() for field in fields}


def texts(path: str, field: str) -> Iterator[str]:
    """The documents of one file: a whole .txt file, ``field`` of each .jsonl line,
    or column ``field`` of a parquet file."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            yield f.read()
    elif path.endswith(".jsonl"):
        for number, row in read_jsonl(path):
            if field not in row:
                raise _missing_field(path, f", line {number}", field, row)
            yield _as_text(row[field], path, field)
    else:
        for columns in parquet_columns(path, [field]):
            for value in columns[field]:
                yield _as_text(value, path, field)


def _as_text(value: Any, path: str, field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{path}: field {field!r} holds {type(value).__name__}, not text")
    return value


def columns(
    source: Any, fields: Sequence[str], *, what: str, optional: Sequence[str] = ()
) -> dict[str, list]:
    """``fields`` (and those of ``optional`` that exist) of every row of ``source``:
    JSON-lines or parquet files, or a ``datasets.Dataset``, into lists. A missing
    field is an error listing the fields that exist."""
    if is_hf_dataset(source):
        present = list(source.column_names)
        for field in fields:
            if field not in present:
                raise KeyError(
                    f"{what}: the dataset has no column {field!r}; its columns are {present}"
                )
        wanted = list(fields) + [f for f in optional if f in present]
        return {field: list(source[field]) for field in wanted}
    out: dict[str, list] = {}
    wanted: list[str] | None = None
    for index, path in enumerate(expand_paths(source, ROW_SUFFIXES, what=what)):
        if path.endswith(".jsonl"):
            for number, row in read_jsonl(path):
                if wanted is None:
                    wanted = list(fields) + [f for f in optional if f in row]
                    out = {field: [] for field in wanted}
                for field in wanted:
                    if field not in row:
                        at = (index, number)
                        raise _missing_field(path, f", line {number}", field, row, at)
                    out[field].append(row[field])
        else:
            pq = hf_import("pyarrow.parquet", needed_by=f"{what} reading {path}")

            if wanted is None:
                names = pq.ParquetFile(path).schema_arrow.names
                wanted = list(fields) + [f for f in optional if f in names]
                out = {field: [] for field in wanted}
            for group in parquet_columns(path, wanted):
                for field in wanted:
                    out[field].extend(group[field])
    if not out or not next(iter(out.values())):
        raise ValueError(f"{what}: {source!r} holds no rows")
    return out
