"""Hugging Face tensor names and layouts <-> Dew parameter paths, both directions.

Torch's ``nn.Linear`` stores ``weight [out, in]``; Dew's dense kernels are
``[in, out]`` and its attention kernels keep heads apart:
``query_kernel [embed, heads, head_dim]``, ``out_kernel [heads, head_dim, embed]``.
GPT-2's ``Conv1D`` already stores ``[in, out]``, and its ``c_attn`` holds the
query, key and value projections side by side (``[embed, 3 * embed]``).

A family describes its checkpoint as a :class:`Layout`: :class:`Tensor`
entries for the global tensors and for one layer. :func:`read_layout` and
:func:`write_layout` turn it into the conversion both ways; they are pure
numpy, so the same code serves files, memory and tests.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor and the Dew parameter(s) it holds.

    name: the Hugging Face name after the model prefix (relative to the layer
      for layer tensors); a tuple of names when several checkpoint tensors make
      the Dew parameter(s) (one file per expert: :func:`experts`).
    paths: Dew parameter paths, ``/``-joined (relative to the layer for layer tensors).
    shape: the Hugging Face shape (of each named tensor).
    to_dew: checkpoint array(s), one per name -> tuple of Dew arrays, one per path.
    to_hf: Dew arrays, one per path -> checkpoint array (a tuple, one per name,
      when ``name`` is a tuple).
    """

    name: str | tuple[str, ...]
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    to_dew: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def same(name: str, path: str, shape: tuple[int, ...]) -> Tensor:
    """Stored as Dew stores it."""
    return Tensor(name, (path,), shape, lambda w: (w,), lambda a: a)


def linear(name: str, path: str, out_features: int, in_features: int) -> Tensor:
    """torch Linear ``[out, in]`` <-> Dew Dense ``[in, out]``."""
    return Tensor(name, (path,), (out_features, in_features), lambda w: (w.T,), lambda k: k.T)


def heads_in(name: str, path: str, heads: int, head_dim: int, embed: int) -> Tensor:
    """Linear ``[heads * head_dim, embed]`` <-> ``[embed, heads, head_dim]``."""
    return Tensor(
        name,
        (path,),
        (heads * head_dim, embed),
        lambda w: (w.T.reshape(embed, heads, head_dim),),
        lambda k: k.reshape(embed, heads * head_dim).T,
    )


def heads_bias(name: str, path: str, heads: int, head_dim: int) -> Tensor:
    """Bias ``[heads * head_dim]`` <-> ``[heads, head_dim]``."""
    return Tensor(
        name,
        (path,),
        (heads * head_dim,),
        lambda b: (b.reshape(heads, head_dim),),
        lambda b: b.reshape(heads * head_dim),
    )


def heads_out(
    name: str, path: str, heads: int, head_dim: int, embed: int, *, transposed: bool
) -> Tensor:
    """``[embed, heads * head_dim]`` (Linear, ``transposed``) or ``[heads * head_dim, embed]``
    (Conv1D) <-> ``out_kernel [heads, head_dim, embed]``."""
    if transposed:
        return Tensor(
            name,
            (path,),
            (embed, heads * head_dim),
            lambda w: (w.T.reshape(heads, head_dim, embed),),
            lambda k: k.reshape(heads * head_dim, embed).T,
        )
    return Tensor(
        name,
        (path,),
        (heads * head_dim, embed),
        lambda w: (w.reshape(heads, head_dim, embed),),
        lambda k: k.reshape(heads * head_dim, embed),
    )


def fused_qkv(name: str, heads: int, head_dim: int, embed: int, *, bias: bool) -> Tensor:
    """GPT-2 ``c_attn``: Conv1D ``[embed, 3 * heads * head_dim]`` (or its bias) <-> q, k, v."""
    width = heads * head_dim
    kind = "bias" if bias else "kernel"
    paths = tuple(f"attention/{p}_{kind}" for p in ("query", "key", "value"))
    if bias:
        return Tensor(
            name,
            paths,
            (3 * width,),
            lambda b: tuple(x.reshape(heads, head_dim) for x in np.split(b, 3)),
            lambda *bs: np.concatenate([x.reshape(width) for x in bs]),
        )
    return Tensor(
        name,
        paths,
        (embed, 3 * width),
        lambda w: tuple(x.reshape(embed, heads, head_dim) for x in np.split(w, 3, 1)),
        lambda *ks: np.concatenate([k.reshape(embed, width) for k in ks], 1),
    )


def experts(name: str, path: str, num_experts: int, out_features: int, in_features: int) -> Tensor:
    """One torch Linear ``[out, in]`` per expert, ``name`` with ``{j}`` for the
    expert (``mlp.experts.{j}.up_proj.weight``) <-> Dew's ``[expert, in, out]``."""
    return Tensor(
        tuple(name.format(j=j) for j in range(num_experts)),
        (path,),
        (out_features, in_features),
        lambda *ws: (np.stack([w.T for w in ws]),),
        lambda k: tuple(np.ascontiguousarray(w.T) for w in k),
    )


def fused_experts(
    name: str, paths: tuple[str, ...], num_experts: int, out_features: int, in_features: int
) -> Tensor:
    """transformers 5's in-memory expert tensor ``[expert, len(paths) * out, in]``
    (``gate_up_proj``: gate then up; ``down_proj``) <-> Dew's ``[expert, in, out]`` per path."""
    parts = len(paths)
    return Tensor(
        name,
        paths,
        (num_experts, parts * out_features, in_features),
        lambda w: tuple(p.transpose(0, 2, 1) for p in np.split(w, parts, axis=1)),
        lambda *ks: np.concatenate([k.transpose(0, 2, 1) for k in ks], axis=1),
    )


def patch_embedding(name: str, kernel: tuple[int, ...], channels: int, embed: int) -> Tensor:
    """``Conv2d`` / ``Conv3d`` weight ``[embed, channels, *kernel]`` (kernel = stride) <->
    dense kernel ``[prod(kernel) * channels, embed]`` over patches flattened as
    ``(*kernel axes, channel)``: ``(row, column, channel)`` or ``(frame, row, column, channel)``."""
    n = len(kernel)
    flat = int(np.prod(kernel)) * channels
    return Tensor(
        name,
        ("patch_embed/kernel",),
        (embed, channels, *kernel),
        lambda w: (w.transpose(*range(2, n + 2), 1, 0).reshape(flat, embed),),
        lambda k: k.reshape(*kernel, channels, embed).transpose(n + 1, n, *range(n)),
    )


def lm_head(vocab: int, embed: int, *, tied: bool) -> Tensor | None:
    """``lm_head.weight [vocab, embed]`` (a Linear) <-> ``lm_head/kernel``; None when tied."""
    return None if tied else linear("lm_head.weight", "lm_head/kernel", vocab, embed)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A family's tensors: ``prefix + global.name``, ``prefix + layer.format(i=i) +
    per_layer.name`` and an optional untied ``lm_head`` (no prefix).

    buffers: names of stored tensors that are not parameters (old checkpoints
      saved rotary tables and attention masks); they are skipped.
    layer_tensors: layer ``i``'s tensors when the layers differ (dense and
      expert feed-forward blocks in one model; read and written unstacked,
      ``layer_{i}``); None = ``per_layer`` for every layer.
    """

    prefix: str
    layer: str
    globals: tuple[Tensor, ...]
    per_layer: tuple[Tensor, ...]
    lm_head: Tensor | None
    buffers: re.Pattern
    layer_tensors: Callable[[int], tuple[Tensor, ...]] | None = None


def loop_prefix(i: int) -> str:
    """Where a looped (unscanned) stack keeps layer ``i``: ``layer_{i}``."""
    return f"layer_{i}"


def read_layout(
    layout: Layout,
    tensors: Mapping[str, np.ndarray],
    *,
    num_layers: int,
    stacked: bool,
    dtype,
    family: str,
    where: str = "",
    layer_prefix: Callable[[int], str] = loop_prefix,
) -> dict[str, np.ndarray]:
    """``{'/'-joined Dew path: array}`` from checkpoint ``tensors``, cast to ``dtype``.

    tensors: the checkpoint's ``{name: array}``; read one name at a time, so a
      lazy mapping over files keeps one tensor in memory at once.
    stacked: layer parameters as one ``[layers, ...]`` array per path (a scanned
      stack) under ``layer_prefix(0)``, or layer ``i``'s under ``layer_prefix(i)``.
    Raises when a tensor is missing, has the wrong shape, or is not part of the model.
    """
    where = f"{where}: " if where else ""
    names = set(tensors.keys())
    # CausalLM checkpoints prefix the backbone ('model.', 'transformer.'); bare ones do not.
    prefix = layout.prefix if any(n.startswith(layout.prefix) for n in names) else ""
    used: set[str] = set()
    flat: dict[str, np.ndarray] = {}
    dtype = np.dtype(dtype)

    def one(tensor: Tensor, name: str) -> np.ndarray:
        if name not in names:
            raise ValueError(
                f"{where}the checkpoint has no tensor {name!r} (the config needs it, with "
                f"shape {tensor.shape}, for Dew's {', '.join(tensor.paths)})"
            )
        value = np.asarray(tensors[name])
        if value.shape != tensor.shape:
            raise ValueError(
                f"{where}tensor {name!r} has shape {value.shape}, but config.json needs "
                f"{tensor.shape} (for Dew's {', '.join(tensor.paths)})"
            )
        used.add(name)
        return value

    def load(tensor: Tensor, start: str) -> tuple[np.ndarray, ...]:
        parts = (tensor.name,) if isinstance(tensor.name, str) else tensor.name
        values = [one(tensor, start + n) for n in parts]
        return tuple(np.asarray(a, dtype) for a in tensor.to_dew(*values))

    for tensor in layout.globals:
        flat.update(zip(tensor.paths, load(tensor, prefix)))
    if layout.lm_head is not None:
        flat.update(zip(layout.lm_head.paths, load(layout.lm_head, "")))
    else:
        used.add("lm_head.weight")  # tied: a stored copy of the embedding is redundant
    if layout.layer_tensors is not None:  # layers that differ: one at a time, unstacked
        if stacked:
            raise ValueError(f"{where}layers that differ cannot be read into a scanned stack")
        for i in range(num_layers):
            for tensor in layout.layer_tensors(i):
                arrays = load(tensor, prefix + layout.layer.format(i=i))
                flat.update({f"{layer_prefix(i)}/{p}": x for p, x in zip(tensor.paths, arrays)})
    for tensor in layout.per_layer if layout.layer_tensors is None else ():
        per_path: dict[str, list[np.ndarray]] = {p: [] for p in tensor.paths}
        for i in range(num_layers):
            arrays = load(tensor, prefix + layout.layer.format(i=i))
            for path, value in zip(tensor.paths, arrays):
                per_path[path].append(value)
        for path, values in per_path.items():
            if stacked:
                flat[f"{layer_prefix(0)}/{path}"] = np.stack(values)
            else:
                flat.update({f"{layer_prefix(i)}/{path}": x for i, x in enumerate(values)})

    unknown = sorted(n for n in names - used if not layout.buffers.search(n))
    if unknown:
        shown = unknown[:8] + (["..."] if len(unknown) > 8 else [])
        raise ValueError(
            f"{where}the checkpoint holds {len(unknown)} tensor(s) a {family} model of this "
            f"config does not have: {shown}; they may mean an architecture Dew does not support"
        )
    return flat


def write_layout(
    layout: Layout,
    flat: Mapping[str, np.ndarray],
    *,
    num_layers: int,
    stacked: bool,
    layer_prefix: Callable[[int], str] = loop_prefix,
) -> dict[str, np.ndarray]:
    """The checkpoint's ``{name: array}`` from ``{'/'-joined Dew path: array}`` (same
    dtype); ``stacked`` and ``layer_prefix`` as in :func:`read_layout`."""
    out = {}

    def put(tensor: Tensor, start: str, arrays) -> None:
        value = tensor.to_hf(*arrays)
        if isinstance(tensor.name, str):
            out[start + tensor.name] = value
        else:
            out.update((start + n, v) for n, v in zip(tensor.name, value, strict=True))

    for tensor in layout.globals:
        put(tensor, layout.prefix, [flat[p] for p in tensor.paths])
    if layout.lm_head is not None:
        put(layout.lm_head, "", [flat[p] for p in layout.lm_head.paths])
    for i in range(num_layers):
        tensors = layout.per_layer if layout.layer_tensors is None else layout.layer_tensors(i)
        for tensor in tensors:
            arrays = [
                flat[f"{layer_prefix(0)}/{p}"][i] if stacked else flat[f"{layer_prefix(i)}/{p}"]
                for p in tensor.paths
            ]
            put(tensor, layout.prefix + layout.layer.format(i=i), arrays)
    return out
