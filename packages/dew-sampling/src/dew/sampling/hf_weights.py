"""Hugging Face tensor names and layouts <-> :class:`dew.nn.CausalTransformer` params.

Torch's ``nn.Linear`` stores ``weight [out, in]``; Dew's dense kernels are
``[in, out]`` and its attention kernels keep heads apart:
``query_kernel [embed, heads, head_dim]``, ``out_kernel [heads, head_dim, embed]``.
GPT-2's ``Conv1D`` already stores ``[in, out]``, and its ``c_attn`` holds the
query, key and value projections side by side (``[embed, 3 * embed]``).
Rotary embeddings use the same rotate-half layout on both sides, so no
permutation is needed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dew.sampling.checkpoint_files import TensorReader


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor and the Dew parameter(s) it holds.

    name: the Hugging Face name after the model prefix; ``{i}`` is the layer.
    paths: Dew parameter paths, ``/``-joined (relative to the layer for layer tensors).
    shape: the Hugging Face shape.
    to_dew: checkpoint array -> tuple of Dew arrays, one per path.
    to_hf: Dew arrays -> checkpoint array.
    """

    name: str
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    to_dew: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def _same(name, path, shape):
    return Tensor(name, (path,), shape, lambda w: (w,), lambda a: a)


def _linear(name, path, out_features, in_features):
    """torch Linear ``[out, in]`` <-> Dew Dense ``[in, out]``."""
    return Tensor(name, (path,), (out_features, in_features), lambda w: (w.T,), lambda k: k.T)


def _heads_in(name, path, heads, head_dim, embed):
    """Linear ``[heads * head_dim, embed]`` <-> ``[embed, heads, head_dim]``."""
    return Tensor(
        name,
        (path,),
        (heads * head_dim, embed),
        lambda w: (w.T.reshape(embed, heads, head_dim),),
        lambda k: k.reshape(embed, heads * head_dim).T,
    )


def _heads_bias(name, path, heads, head_dim):
    return Tensor(
        name,
        (path,),
        (heads * head_dim,),
        lambda b: (b.reshape(heads, head_dim),),
        lambda b: b.reshape(heads * head_dim),
    )


def _heads_out(name, path, heads, head_dim, embed, *, transposed: bool):
    """``[embed, heads * head_dim]`` (Linear) or ``[heads * head_dim, embed]`` (Conv1D)
    <-> ``out_kernel [heads, head_dim, embed]``."""
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


def _fused_qkv(name, heads, head_dim, embed, *, bias: bool):
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """A family's tensor names: ``prefix + global`` and ``prefix + layer.format(i) + per-layer``."""

    prefix: str
    layer: str
    globals: tuple[Tensor, ...]
    per_layer: tuple[Tensor, ...]
    lm_head: Tensor | None
    buffers: re.Pattern  # tensors that are not parameters (old checkpoints saved them)


def layout(model, family: str) -> Layout:
    """The tensors of ``model`` in a ``family`` checkpoint."""
    e, h, kv = model.emb_features, model.num_heads, model.kv_heads
    d, m, v = model.head_dim or e // h, model.mlp_features, model.vocab_size
    lm_head = None if model.tie_embeddings else _linear("lm_head.weight", "lm_head/kernel", v, e)
    if family == "gpt2":
        per_layer = [
            _same("ln_1.weight", "attention_norm/scale", (e,)),
            _same("ln_1.bias", "attention_norm/bias", (e,)),
            _fused_qkv("attn.c_attn.weight", h, d, e, bias=False),
            _fused_qkv("attn.c_attn.bias", h, d, e, bias=True),
            _heads_out("attn.c_proj.weight", "attention/out_kernel", h, d, e, transposed=False),
            _same("attn.c_proj.bias", "attention/out_bias", (e,)),
            _same("ln_2.weight", "mlp_norm/scale", (e,)),
            _same("ln_2.bias", "mlp_norm/bias", (e,)),
            _same("mlp.c_fc.weight", "mlp/up/kernel", (e, m)),
            _same("mlp.c_fc.bias", "mlp/up/bias", (m,)),
            _same("mlp.c_proj.weight", "mlp/down/kernel", (m, e)),
            _same("mlp.c_proj.bias", "mlp/down/bias", (e,)),
        ]
        globals_ = [
            _same("wte.weight", "embed/embedding", (v, e)),
            _same("wpe.weight", "position_embed", (model.max_seq_len, e)),
            _same("ln_f.weight", "final_norm/scale", (e,)),
            _same("ln_f.bias", "final_norm/bias", (e,)),
        ]
        return Layout(
            "transformer.",
            "h.{i}.",
            tuple(globals_),
            tuple(per_layer),
            lm_head,
            re.compile(r"\.attn\.(masked_)?bias$"),
        )
    per_layer = [
        _same("input_layernorm.weight", "attention_norm/scale", (e,)),
        _heads_in("self_attn.q_proj.weight", "attention/query_kernel", h, d, e),
        _heads_in("self_attn.k_proj.weight", "attention/key_kernel", kv, d, e),
        _heads_in("self_attn.v_proj.weight", "attention/value_kernel", kv, d, e),
        _heads_out("self_attn.o_proj.weight", "attention/out_kernel", h, d, e, transposed=True),
        _same("post_attention_layernorm.weight", "mlp_norm/scale", (e,)),
        _linear("mlp.gate_proj.weight", "mlp/gate/kernel", m, e),
        _linear("mlp.up_proj.weight", "mlp/up/kernel", m, e),
        _linear("mlp.down_proj.weight", "mlp/down/kernel", e, m),
    ]
    if family == "qwen2":
        per_layer += [
            _heads_bias("self_attn.q_proj.bias", "attention/query_bias", h, d),
            _heads_bias("self_attn.k_proj.bias", "attention/key_bias", kv, d),
            _heads_bias("self_attn.v_proj.bias", "attention/value_bias", kv, d),
        ]
    globals_ = [
        _same("embed_tokens.weight", "embed/embedding", (v, e)),
        _same("norm.weight", "final_norm/scale", (e,)),
    ]
    return Layout(
        "model.",
        "layers.{i}.",
        tuple(globals_),
        tuple(per_layer),
        lm_head,
        re.compile(r"\.rotary_emb\.inv_freq$"),
    )


def param_shapes(model) -> dict[str, jax.ShapeDtypeStruct]:
    """``{'/'-joined path: shape}`` of the model's parameters (traced, nothing computed)."""
    shapes = jax.eval_shape(
        model.init, jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((1, 1), jnp.int32)
    )
    return traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")


def _layer_path(model, i: int, path: str) -> str:
    return f"layers/{path}" if model.use_scan else f"layer_{i}/{path}"


def read_params(reader: TensorReader, model, family: str) -> dict:
    """Dew params (numpy, the model's ``param_dtype``) from a ``family`` checkpoint."""
    lay = layout(model, family)
    names = reader.names
    # CausalLM checkpoints prefix the backbone ('model.', 'transformer.'); bare ones do not.
    prefix = lay.prefix if any(n.startswith(lay.prefix) for n in names) else ""
    used: set[str] = set()
    flat: dict[str, np.ndarray] = {}
    dtype = np.dtype(model.param_dtype)

    def load(tensor: Tensor, name: str, paths: tuple[str, ...]) -> list[np.ndarray]:
        if name not in names:
            raise ValueError(
                f"{reader.directory}: the checkpoint has no tensor {name!r} (the "
                f"config needs it, with shape {tensor.shape})"
            )
        shape = reader.shape(name)
        if shape != tensor.shape:
            raise ValueError(
                f"{reader.directory}: tensor {name!r} has shape {shape}, but config.json "
                f"needs {tensor.shape} (for Dew's {', '.join(paths)})"
            )
        used.add(name)
        return [np.asarray(a, dtype) for a in tensor.to_dew(reader.get(name))]

    for tensor in lay.globals:
        for path, value in zip(tensor.paths, load(tensor, prefix + tensor.name, tensor.paths)):
            flat[path] = value
    if lay.lm_head is not None:
        flat["lm_head/kernel"] = load(lay.lm_head, "lm_head.weight", lay.lm_head.paths)[0]
    else:
        used.add("lm_head.weight")  # tied: a stored copy of the embedding is redundant
    for tensor in lay.per_layer:
        per_path = {p: [] for p in tensor.paths}
        for i in range(model.num_layers):
            name = prefix + lay.layer.format(i=i) + tensor.name
            for path, value in zip(tensor.paths, load(tensor, name, tensor.paths)):
                per_path[path].append(value)
        for path, values in per_path.items():
            if model.use_scan:
                flat[f"layers/{path}"] = np.stack(values)
            else:
                flat.update({_layer_path(model, i, path): x for i, x in enumerate(values)})

    unknown = sorted(n for n in names - used if not lay.buffers.search(n))
    if unknown:
        shown = unknown[:8] + (["..."] if len(unknown) > 8 else [])
        raise ValueError(
            f"{reader.directory}: the checkpoint holds {len(unknown)} tensor(s) "
            f"a {family} model of this config does not have: {shown}; they may "
            f"mean an architecture Dew does not support"
        )
    _check_against_model(model, flat)
    return traverse_util.unflatten_dict(flat, sep="/")


def _check_against_model(model, flat: dict[str, np.ndarray]) -> None:
    expected = param_shapes(model)
    if set(expected) != set(flat):
        raise AssertionError(
            f"Dew's converter and CausalTransformer disagree on the parameters: missing "
            f"{sorted(set(expected) - set(flat))}, extra {sorted(set(flat) - set(expected))}"
        )
    for path, spec in expected.items():
        if tuple(spec.shape) != flat[path].shape:
            raise AssertionError(
                f"converted {path} has shape {flat[path].shape}, the model "
                f"expects {tuple(spec.shape)}"
            )


def hf_tensors(params, model, family: str) -> dict[str, np.ndarray]:
    """The ``{name: array}`` of a ``family`` checkpoint holding ``params`` (numpy, same dtype)."""
    flat = {
        k: np.asarray(jax.device_get(v))
        for k, v in traverse_util.flatten_dict(params, sep="/").items()
    }
    _check_against_model(model, flat)
    lay = layout(model, family)
    out = {}
    for tensor in lay.globals:
        out[lay.prefix + tensor.name] = tensor.to_hf(*(flat[p] for p in tensor.paths))
    if lay.lm_head is not None:
        out["lm_head.weight"] = lay.lm_head.to_hf(flat["lm_head/kernel"])
    for i in range(model.num_layers):
        for tensor in lay.per_layer:
            arrays = [
                flat[f"layers/{p}"][i] if model.use_scan else flat[_layer_path(model, i, p)]
                for p in tensor.paths
            ]
            out[lay.prefix + lay.layer.format(i=i) + tensor.name] = tensor.to_hf(*arrays)
    return out
