"""Reading and writing a directory of safetensors files, sharded or not.

Only safetensors are read: a ``.bin``/``.pt``/``.ckpt`` file is a pickle,
and unpickling runs code from the file. The ``safetensors`` library does the
parsing (its numpy API; bfloat16 through ``ml_dtypes``).

A sharded checkpoint is Hugging Face's layout: ``model-00001-of-00003.safetensors``
... plus ``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: file name}}``.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator, Mapping

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class TensorReader(Mapping):
    """The tensors of a checkpoint directory as a read-only ``{name: array}``,
    each read from its file when it is looked up."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        index = self.directory / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({f for f in weight_map.values() if not (self.directory / f).exists()})
            if missing:
                raise FileNotFoundError(
                    f"{index} names shard file(s) {missing} that are not in {self.directory}"
                )
            self.files = dict(weight_map)
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLES)
                hint = (
                    f" It holds {pickles}: pickle files, which Dew never loads because "
                    f"unpickling runs code from the file; convert them to safetensors with "
                    f"a tool you trust"
                    if pickles
                    else ""
                )
                raise FileNotFoundError(f"no *.safetensors weights in {self.directory}.{hint}")
            self.files = {}
            for file in files:
                with safe_open(file, framework="numpy") as f:
                    for name in f.keys():
                        self.files[name] = file.name

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self.directory / self.files[name], framework="numpy") as f:
            return tuple(f.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"{self.directory} holds no tensor {name!r}")
        with safe_open(self.directory / self.files[name], framework="numpy") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def remove_weights(directory: str | os.PathLike) -> None:
    """Delete the weight files a previous save left (``model*.safetensors`` and the index)."""
    directory = pathlib.Path(directory)
    for path in [directory / INDEX, *directory.glob("model*.safetensors")]:
        if path.exists():
            path.unlink()


def write_tensors(
    directory: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards of at most
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own) plus
    the index. Returns the file names written."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_weights(directory)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {"format": "pt"}  # transformers refuses files without it
    if max_shard_bytes is None:
        save_file(tensors, directory / SINGLE, metadata=metadata)
        return [SINGLE]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / INDEX).write_text(json.dumps(index, indent=2))
    return names
