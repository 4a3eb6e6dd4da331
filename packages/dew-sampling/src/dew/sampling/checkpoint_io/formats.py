"""The two checkpoint formats on disk, read and written.

- **Hugging Face** (``config.json``): a family of :mod:`dew.nn.hf` (Llama,
  Mistral, Qwen2, GPT-2), with ``*.safetensors`` weights (one file or shards
  with ``model.safetensors.index.json``) and ``tokenizer.json`` when present.
  The family's :class:`~dew.nn.hf.HFFormat` maps the config and the tensors;
  this module reads and writes the files.
- **Dew** (``dew_config.json``), for models trained from scratch::

      {"format": "dew", "version": 1,
       "model": {"name": <models registry name>, "config": <models.config_of(model)[1]>},
       "tokenizer": null | {"kind": "bytes"} | {"kind": "hf"},
       "end_ids": [<ids that end a generation>],
       "diffusion": <absent, or how a diffusion model samples:
                     dew.sampling.diffusion_pipelines>}

  beside ``model.safetensors``, whose tensor names are the ``/``-joined
  parameter paths (``layers/attention/query_kernel``), stored in the
  parameters' own dtype; ``{"kind": "hf"}`` means ``tokenizer.json`` (and
  ``tokenizer_config.json``) lie in the same directory.

Loading never runs code from the checkpoint: no ``trust_remote_code``, no
pickle; it needs neither torch nor transformers.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dew.data import ByteTokenizer, HFTokenizer
from dew.nn import hf, models
from dew.nn.keywords import is_whole_number
from dew.sampling.checkpoint_io.byte_level import save_byte_tokenizer
from dew.sampling.checkpoint_io.files import (
    TensorReader,
    read_json_object,
    write_tensors,
)

DEW_CONFIG = "dew_config.json"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # transformers' generation defaults (token ids)


def formats() -> tuple[str, ...]:
    """Every format a checkpoint can be saved in: ``'dew'`` and the Hugging Face families."""
    return ("dew", *hf.names())


def check_format(format: str) -> None:
    if format not in formats():
        raise ValueError(f"unknown format {format!r}; use one of {', '.join(formats())}")


def config_token_ids(config: dict[str, Any] | None, field: str, where: str) -> list[int]:
    """The ids of ``field`` of a Hugging Face config (``eos_token_id``: one id, a list
    or null; ``pad_token_id``: one id or null) as a list; another value raises,
    naming the file ``where``."""
    value = (config or {}).get(field)
    values = value if isinstance(value, list) else [value]
    if not all(v is None or is_whole_number(v) for v in values):
        raise ValueError(
            f"{where}: {field}={value!r} must be a token id, a list of token ids or null; "
            f"fix the field (or pass the ids yourself: Pretrained(..., end_ids=..., pad_id=...))"
        )
    return [int(v) for v in values if v is not None]


def default_end_ids(
    tokenizer, hf_config: dict[str, Any] | None, generation_config: dict[str, Any] | None = None
) -> tuple[int, ...]:
    """The tokenizer's ``end_id``, then ``eos_token_id`` (one id or a list) of
    ``generation_config.json`` and of ``config.json``, without repeats."""
    ids = []
    if getattr(tokenizer, "end_id", None) is not None:
        ids.append(int(tokenizer.end_id))
    for config, name in ((generation_config, GENERATION_CONFIG), (hf_config, HF_CONFIG)):
        for i in config_token_ids(config, "eos_token_id", name):
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def default_pad_id(
    tokenizer,
    hf_config: dict[str, Any] | None,
    generation_config: dict[str, Any] | None,
    end_ids: tuple[int, ...],
) -> int | None:
    """The first of: ``pad_token_id`` of ``generation_config.json``, of ``config.json``
    (either may be null), the tokenizer's ``pad_id``, the first end id (what
    transformers pads with when a model has no pad token); None when there is none."""
    for config, name in ((generation_config, GENERATION_CONFIG), (hf_config, HF_CONFIG)):
        ids = config_token_ids(config, "pad_token_id", name)
        if ids:
            return ids[0]
    if getattr(tokenizer, "pad_id", None) is not None:
        return int(tokenizer.pad_id)
    return end_ids[0] if end_ids else None


# ------------------------------------------------------------------ read


def read_hf(path: pathlib.Path, *, dtype, param_dtype, use_scan, ignore_fields) -> dict[str, Any]:
    """The fields of a :class:`~dew.sampling.Pretrained` from a Hugging Face checkpoint."""
    config = read_json_object(path / HF_CONFIG, what="the Hugging Face model configuration")
    generation = None
    if (path / GENERATION_CONFIG).exists():
        generation = read_json_object(path / GENERATION_CONFIG, what="the generation defaults")
    fmt = hf.get(hf.family_of(config, str(path)))
    name, options = fmt.config_to_dew(config, where=str(path), ignore_fields=ignore_fields)
    try:
        model = models.build(
            name, **options, dtype=dtype, param_dtype=param_dtype, use_scan=use_scan
        )
    except ValueError as e:
        raise ValueError(
            f"{path / HF_CONFIG} describes a model Dew cannot build: {e}. The file is damaged "
            f"or not a {fmt.family} configuration: fix it or download the checkpoint again"
        ) from None
    params = fmt.params_from_hf(TensorReader(path), model, where=str(path))
    return dict(
        model=model,
        params=jax.tree.map(jnp.asarray, params),
        tokenizer=HFTokenizer(path) if (path / "tokenizer.json").exists() else None,
        format=fmt.family,
        hf_config=config,
        generation_config=generation,
    )


def read_dew(path: pathlib.Path) -> dict[str, Any]:
    """The fields of a :class:`~dew.sampling.Pretrained` from a Dew checkpoint."""
    config = read_json_object(path / DEW_CONFIG, what="the Dew model description")
    if config.get("format") != "dew" or config.get("version") != 1:
        raise ValueError(
            f"{path / DEW_CONFIG}: expected format 'dew' version 1, got "
            f"{config.get('format')!r} version {config.get('version')!r}"
        )
    record = config.get("model")
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise ValueError(
            f"{path / DEW_CONFIG} has no model record {{'name': ..., 'config': {{...}}}}; "
            f"save the checkpoint again with Pretrained.save"
        )
    try:
        model = models.build(record.get("name"), **record["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"{path / DEW_CONFIG} describes a model Dew cannot build: {e.args[0] if e.args else e}"
            f". Fix the file or save the checkpoint again"
        ) from None
    reader = TensorReader(path)
    expected = hf.param_shapes(model)
    missing = sorted(set(expected) - reader.names)
    extra = sorted(reader.names - set(expected))
    if missing or extra:
        raise ValueError(
            f"{path}: the weights do not match the model in {DEW_CONFIG}: "
            f"missing tensors {missing}, unexpected tensors {extra}"
        )
    flat = {}
    for name, spec in expected.items():
        shape = reader.shape(name)
        if shape != tuple(spec.shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {shape}, but the model in "
                f"{DEW_CONFIG} needs {tuple(spec.shape)}"
            )
        flat[name] = jnp.asarray(reader[name])
    kind = (config.get("tokenizer") or {}).get("kind")
    if kind not in (None, "bytes", "hf"):
        raise ValueError(
            f"{path / DEW_CONFIG}: unknown tokenizer kind {kind!r}; expected null, 'bytes' or 'hf'"
        )
    tokenizer = {None: None, "bytes": ByteTokenizer(), "hf": None}[kind]
    if kind == "hf":
        tokenizer = HFTokenizer(path)
    end_ids = config.get("end_ids")
    return dict(
        model=model,
        params=traverse_util.unflatten_dict(flat, sep="/"),
        tokenizer=tokenizer,
        format="dew",
        end_ids=None if end_ids is None else tuple(end_ids),
        diffusion=config.get("diffusion"),
    )


# ------------------------------------------------------------------ write


def write(
    path: pathlib.Path,
    *,
    model,
    params,
    tokenizer,
    format: str,
    end_ids: tuple[int, ...],
    hf_config: dict[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    diffusion: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a checkpoint of ``format`` to directory ``path`` (created if needed).

    hf_config: the ``config.json`` the weights came from, when ``format`` is
      that same family: the fields Dew ignores (token ids, ...) are kept.
    diffusion: a Dew checkpoint's ``"diffusion"`` section (how a diffusion model
      samples, :mod:`dew.sampling.diffusion.pipelines`); None = none.
    generation_config: a Hugging Face checkpoint's ``generation_config.json``, written
      back beside ``config.json``; None = none.
    """
    check_format(format)
    params = nn.meta.unbox(params)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if format == "dew":
        _write_dew(path, model, params, tokenizer, end_ids, max_shard_bytes, diffusion)
    else:
        _write_hf(path, model, params, tokenizer, format, end_ids, hf_config, max_shard_bytes)
        if generation_config is not None:
            text = json.dumps(generation_config, indent=2, sort_keys=True)
            (path / GENERATION_CONFIG).write_text(text)
    return path


def write_peft(
    path, *, model, params, lora, family: str, base_model_name_or_path: str | None
) -> pathlib.Path:
    """A PEFT adapter directory of ``lora``'s adapters in ``params`` (base + adapters)
    for a Hugging Face ``family``: ``adapter_config.json`` and
    ``adapter_model.safetensors`` (:mod:`dew.nn.hf.peft`)."""
    from dew.nn.hf import peft

    fmt = hf.get(family)
    if not hasattr(fmt, "layout"):
        raise ValueError(f"PEFT export covers the causal-LM families; {family} is not one")
    params = nn.meta.unbox(params)
    tensors, modules = peft.adapter_tensors(fmt, model, jax.device_get(params))
    if not tensors:
        raise ValueError("the parameters hold no LoRA adapters (no *_lora_a / *_lora_b leaves)")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tensors(path, tensors, name="adapter_model")
    config = peft.adapter_config(lora, modules, base_model_name_or_path=base_model_name_or_path)
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _write_hf(path, model, params, tokenizer, family, end_ids, base, max_shard_bytes):
    fmt = hf.get(family)
    if getattr(type(model), "registry_name", None) != fmt.registry_name:
        raise TypeError(
            f"only a {models.get(fmt.registry_name).__name__} saves as {family}; got "
            f"{type(model).__name__} (use format='dew')"
        )
    tensors = fmt.params_to_hf(params, model)
    config = fmt.config_from_dew(model, base=base, dtype_name=_dtype_name(tensors))
    if base is None and end_ids:
        config["eos_token_id"] = end_ids[0] if len(end_ids) == 1 else list(end_ids)
    weights_name = getattr(fmt, "weights_name", "model")  # diffusers: diffusion_pytorch_model
    write_tensors(path, tensors, max_shard_bytes=max_shard_bytes, name=weights_name)
    (path / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_tokenizer(path, tokenizer, allow_bytes=False)


def _write_dew(path, model, params, tokenizer, end_ids, max_shard_bytes, diffusion=None):
    name, config = models.config_of(model)
    flat = traverse_util.flatten_dict(params, sep="/")
    tensors = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
    write_tensors(path, tensors, max_shard_bytes=max_shard_bytes)
    description = {
        "format": "dew",
        "version": 1,
        "model": {"name": name, "config": config},
        "tokenizer": _write_tokenizer(path, tokenizer, allow_bytes=True),
        "end_ids": list(end_ids),
    }
    if diffusion is not None:
        description["diffusion"] = diffusion
    (path / DEW_CONFIG).write_text(json.dumps(description, indent=2))


def _write_tokenizer(path, tokenizer, *, allow_bytes: bool):
    if tokenizer is None:
        return None
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.save(path)
        return {"kind": "hf"}
    if isinstance(tokenizer, ByteTokenizer) and allow_bytes:
        return {"kind": "bytes"}
    if isinstance(tokenizer, ByteTokenizer):  # the same ids, as a tokenizer.json
        save_byte_tokenizer(tokenizer, path)
        return {"kind": "hf"}
    raise TypeError(
        f"cannot save a tokenizer of type {type(tokenizer).__name__}; "
        f"Pretrained saves ByteTokenizer and HFTokenizer (or tokenizer=None)"
    )


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
    dtypes = {np.dtype(v.dtype).name for v in tensors.values()}
    return dtypes.pop() if len(dtypes) == 1 else "float32"
