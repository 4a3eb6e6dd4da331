"""Open one split of a Hugging Face ``datasets`` dataset from an object, a path or a name."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from dew.data._extra import hf_import

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _looks_local(path: str) -> bool:
    """A path rather than a Hub name ("name" or "owner/name")."""
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") >= 2
        or os.path.splitext(path)[1] in _BUILDERS
    )


@contextlib.contextmanager
def _quiet_progress():
    """``datasets``' progress bars off while it prepares a local folder (a trainer's
    log is no place for them), then back as they were."""
    hf_logging = hf_import("datasets.utils.logging", needed_by="reading with datasets")

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_split(source: Any, split: str, *, what: str, cache_dir: str | None = None):
    """The ``split`` of ``source`` as a ``datasets.Dataset``.

    source: a ``datasets.Dataset`` (used as is), a ``DatasetDict``, a directory
      written by ``save_to_disk``, a local data directory (an image folder,
      parquet or JSON files: ``datasets.load_dataset(path)``), a single
      parquet/JSON/CSV file, or a dataset name on the Hugging Face Hub.
    cache_dir: where ``datasets`` keeps what it prepares (None = its default).
    """
    datasets = hf_import("datasets", needed_by=what)

    if isinstance(source, datasets.Dataset):
        return source
    if isinstance(source, datasets.DatasetDict):
        loaded = source
        described = "the DatasetDict"
    else:
        path = os.path.expanduser(os.fspath(source))
        described = repr(path)
        if os.path.isdir(path) and any(
            os.path.exists(os.path.join(path, name))
            for name in ("dataset_info.json", "state.json", "dataset_dict.json")
        ):
            loaded = datasets.load_from_disk(path)
        elif os.path.isfile(path):
            builder = _BUILDERS.get(os.path.splitext(path)[1])
            if builder is None:
                raise ValueError(
                    f"{what}: cannot read {path!r}; give a directory, a dataset name, or a "
                    f"file ending in {', '.join(_BUILDERS)}"
                )
            with _quiet_progress():
                loaded = datasets.load_dataset(builder, data_files=path, cache_dir=cache_dir)
        elif os.path.isdir(path):
            with _quiet_progress():
                loaded = datasets.load_dataset(path, cache_dir=cache_dir)
        elif _looks_local(path):
            raise FileNotFoundError(f"{what}: no such file or directory: {path!r}")
        else:
            loaded = datasets.load_dataset(path, cache_dir=cache_dir)
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split not in loaded:
        raise KeyError(f"{what}: {described} has no split {split!r}; its splits are {list(loaded)}")
    return loaded[split]


def pick_column(
    dataset, requested: str | None, *, auto: tuple[str, ...], what: str, role: str
) -> str | None:
    """The column to read for ``role``: ``requested`` (which must exist), the first of
    ``auto`` present when ``requested`` is "auto", or None."""
    present = list(dataset.column_names)
    if requested is None:
        return None
    if requested == "auto":
        return next((name for name in auto if name in present), None)
    if requested not in present:
        raise KeyError(f"{what}: no {role} column {requested!r}; the columns are {present}")
    return requested
