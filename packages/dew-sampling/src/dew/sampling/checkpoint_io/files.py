"""Reading and writing a directory of safetensors files, sharded or not.

Only safetensors are read: a ``.bin``/``.pt``/``.ckpt`` file is a pickle,
and unpickling runs code from the file. The ``safetensors`` library does the
parsing (its numpy API; bfloat16 through ``ml_dtypes``).

A sharded checkpoint is Hugging Face's layout: ``model-00001-of-00003.safetensors``
... plus ``model.safetensors.index.json`` = ``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: file name}}``. diffusers names the same files
``diffusion_pytorch_model*`` (``write_tensors(..., name=...)``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: pathlib.Path, *, what: str = "") -> Any:
    """The JSON value in file ``path``; a file that does not parse raises a
    ``ValueError`` naming it, where it stops parsing and what to do.

    what: what the file is, for the message (``'the model configuration'``).
    """
    text = pathlib.Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        kind = f" ({what})" if what else ""
        empty = " The file is empty." if not text.strip() else ""
        raise ValueError(
            f"{path}{kind} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
            f"({len(text)} characters).{empty} It is damaged or was cut off while being "
            f"written or downloaded: download or save the checkpoint again, or fix the file"
        ) from None


def read_json_object(path: pathlib.Path, *, what: str = "") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object (``{...}``)."""
    value = read_json(path, what=what)
    if not isinstance(value, dict):
        kind = f" ({what})" if what else ""
        raise ValueError(
            f"{path}{kind} holds a JSON {type(value).__name__}, not an object {{...}}; "
            f"download or save the checkpoint again, or fix the file"
        )
    return value


@contextlib.contextmanager
def open_safetensors(file: pathlib.Path):
    """``safe_open(file)`` (numpy); a file whose header or data do not parse (cut
    off, empty, not safetensors) raises a ``ValueError`` naming it and its size."""
    try:
        handle = safe_open(file, framework="numpy")
    except SafetensorError as e:
        size = file.stat().st_size if file.exists() else 0
        raise ValueError(
            f"{file} is not a readable safetensors file ({e}; the file is {size} bytes): it "
            f"was most likely cut off while being saved or downloaded. Download or save the "
            f"checkpoint again"
        ) from None
    with handle as f:
        yield f


class TensorReader(Mapping):
    """The tensors of a checkpoint directory as a read-only ``{name: array}``,
    each read from its file when it is looked up."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        indexes = sorted(self.directory.glob(f"*{INDEX_SUFFIX}"))
        index = indexes[0] if indexes else self.directory / INDEX
        if index.exists():
            description = read_json_object(index, what="the index of the weight shards")
            weight_map = description.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(
                    f"{index} has no 'weight_map' object ({{tensor name: file name}}); "
                    f"download or save the checkpoint again"
                )
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
                with open_safetensors(file) as f:
                    for name in f.keys():
                        self.files[name] = file.name

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        with open_safetensors(self.directory / self.files[name]) as f:
            return tuple(f.get_slice(name).get_shape())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"{self.directory} holds no tensor {name!r}")
        file = self.directory / self.files[name]
        with open_safetensors(file) as f:
            try:
                return f.get_tensor(name)
            except SafetensorError as e:
                raise ValueError(
                    f"{file}: tensor {name!r} cannot be read ({e}); the file is damaged: "
                    f"download or save the checkpoint again"
                ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def remove_weights(directory: str | os.PathLike, name: str = "model") -> None:
    """Delete the weight files a previous save left (``{name}*.safetensors`` and the index)."""
    directory = pathlib.Path(directory)
    for path in [directory / f"{name}{INDEX_SUFFIX}", *directory.glob(f"{name}*.safetensors")]:
        if path.exists():
            path.unlink()


def write_tensors(
    directory: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
    name: str = "model",
) -> list[str]:
    """Write ``tensors`` as ``{name}.safetensors``, or as shards of at most
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own) plus
    the index. Returns the file names written.

    name: the files' stem: ``'model'`` (transformers) or ``'diffusion_pytorch_model'``
      (diffusers).
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_weights(directory, name)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {"format": "pt"}  # transformers refuses files without it
    if max_shard_bytes is None:
        single = f"{name}.safetensors"
        save_file(tensors, directory / single, metadata=metadata)
        return [single]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    names = [f"{name}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, directory / file, metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
        "weight_map": weight_map,
    }
    (directory / f"{name}{INDEX_SUFFIX}").write_text(json.dumps(index, indent=2))
    return names
