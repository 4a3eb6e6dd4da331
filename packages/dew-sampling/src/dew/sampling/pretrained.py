"""Pretrained checkpoints: load a model, its weights and its tokenizer; save them back.

Two formats, told apart by the file that describes the model:

- **Hugging Face** (``config.json``): Llama, Mistral, Qwen2 and GPT-2 causal
  LMs, with ``*.safetensors`` weights (one file or shards with
  ``model.safetensors.index.json``) and ``tokenizer.json`` when present.
  ``save`` writes the same format back, so transformers loads the result.
- **Dew** (``dew_config.json``), for models trained from scratch::

      {"format": "dew", "version": 1,
       "model": {"name": <models registry name>, "config": <models.config_of(model)[1]>},
       "tokenizer": null | {"kind": "bytes"} | {"kind": "hf"},
       "end_ids": [<ids that end a generation>]}

  beside ``model.safetensors``, whose tensor names are the ``/``-joined
  parameter paths (``layers/attention/query_kernel``), stored in the
  parameters' own dtype; ``{"kind": "hf"}`` means ``tokenizer.json`` (and
  ``tokenizer_config.json``) lie in the same directory.

Loading never runs code from the checkpoint: no ``trust_remote_code``, no
pickle; it needs neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dew.data import ByteTokenizer, HFTokenizer
from dew.nn import models
from dew.nn.backbones import CausalTransformer
from dew.sampling import hf_config, hf_weights
from dew.sampling.byte_level import save_byte_tokenizer
from dew.sampling.checkpoint_files import TensorReader, write_tensors

DEW_CONFIG = "dew_config.json"
HF_CONFIG = "config.json"
FORMATS = ("dew", *hf_config.SUPPORTED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A causal LM with its weights and tokenizer, and the format it came in.

    model: the module (:class:`dew.nn.CausalTransformer` for Hugging Face formats).
    params: its parameter tree (unboxed; numpy or jax arrays).
    tokenizer: ``ByteTokenizer``, ``HFTokenizer`` or None.
    format: what :meth:`save` writes: ``'dew'`` or a Hugging Face family
      (``'llama'``, ``'mistral'``, ``'qwen2'``, ``'gpt2'``).
    hf_config: the ``config.json`` a Hugging Face checkpoint came with; the
      fields Dew ignores (token ids, ...) are written back by :meth:`save`.
    end_ids: token ids that end a generation; None = the tokenizer's ``end_id``
      and the config's ``eos_token_id``.
    """

    model: Any
    params: Any
    tokenizer: Any = None
    format: str = "dew"
    hf_config: dict[str, Any] | None = None
    end_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; use one of {', '.join(FORMATS)}")
        object.__setattr__(self, "params", nn.meta.unbox(self.params))
        if self.end_ids is None:
            ids = []
            if getattr(self.tokenizer, "end_id", None) is not None:
                ids.append(int(self.tokenizer.end_id))
            eos = (self.hf_config or {}).get("eos_token_id")
            for i in eos if isinstance(eos, list) else [eos]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
            object.__setattr__(self, "end_ids", tuple(ids))

    # ------------------------------------------------------------------ load

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        use_scan: bool = True,
        ignore_fields: tuple[str, ...] = (),
    ) -> Pretrained:
        """Read a checkpoint directory (Hugging Face ``config.json`` or Dew ``dew_config.json``).

        dtype: computation dtype of the model (Hugging Face formats).
        param_dtype: the parameters are cast to this dtype (Hugging Face formats;
          a Dew checkpoint keeps the dtype it was saved with).
        use_scan: scan over layers (Hugging Face formats).
        ignore_fields: ``config.json`` fields you know do not change the model;
          unknown fields are an error otherwise (see :mod:`dew.sampling.hf_config`).
        """
        path = pathlib.Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is not a directory; Pretrained.load takes the checkpoint directory"
            )
        if (path / DEW_CONFIG).exists():
            return cls._load_dew(path)
        if (path / HF_CONFIG).exists():
            return cls._load_hf(path, dtype, param_dtype, use_scan, ignore_fields)
        raise FileNotFoundError(
            f"{path} has neither {DEW_CONFIG} (a Dew checkpoint) nor "
            f"{HF_CONFIG} (a Hugging Face checkpoint)"
        )

    @classmethod
    def _load_hf(cls, path, dtype, param_dtype, use_scan, ignore_fields) -> Pretrained:
        config = json.loads((path / HF_CONFIG).read_text())
        family = hf_config.family_of(config, str(path))
        options = hf_config.to_options(config, family, where=str(path), ignore_fields=ignore_fields)
        model = CausalTransformer(
            **options, dtype=dtype, param_dtype=param_dtype, use_scan=use_scan
        )
        model.check()
        params = hf_weights.read_params(TensorReader(path), model, family)
        tokenizer = HFTokenizer(path) if (path / "tokenizer.json").exists() else None
        return cls(
            model=model,
            params=jax.tree.map(jnp.asarray, params),
            tokenizer=tokenizer,
            format=family,
            hf_config=config,
        )

    @classmethod
    def _load_dew(cls, path) -> Pretrained:
        config = json.loads((path / DEW_CONFIG).read_text())
        if config.get("format") != "dew" or config.get("version") != 1:
            raise ValueError(
                f"{path / DEW_CONFIG}: expected format 'dew' version 1, got "
                f"{config.get('format')!r} version {config.get('version')!r}"
            )
        model = models.build(config["model"]["name"], **config["model"]["config"])
        reader = TensorReader(path)
        expected = hf_weights.param_shapes(model)
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
            flat[name] = jnp.asarray(reader.get(name))
        kind = (config.get("tokenizer") or {}).get("kind")
        if kind not in (None, "bytes", "hf"):
            raise ValueError(
                f"{path / DEW_CONFIG}: unknown tokenizer kind {kind!r}; "
                f"expected null, 'bytes' or 'hf'"
            )
        tokenizer = {None: None, "bytes": ByteTokenizer(), "hf": None}[kind]
        if kind == "hf":
            tokenizer = HFTokenizer(path)
        end_ids = config.get("end_ids")
        return cls(
            model=model,
            params=traverse_util.unflatten_dict(flat, sep="/"),
            tokenizer=tokenizer,
            format="dew",
            end_ids=None if end_ids is None else tuple(end_ids),
        )

    # ------------------------------------------------------------------ save

    def save(
        self,
        path: str | os.PathLike,
        *,
        format: str | None = None,
        max_shard_bytes: int | None = None,
    ) -> pathlib.Path:
        """Write the checkpoint to directory ``path`` (created if needed).

        format: None = :attr:`format` (a Hugging Face checkpoint stays one);
          ``'dew'``, or a Hugging Face family the model fits (``'llama'``, ...).
        max_shard_bytes: split the weights into shards of at most this many
          bytes plus ``model.safetensors.index.json``; None = one file.
        """
        format = format or self.format
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; use one of {', '.join(FORMATS)}")
        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if format == "dew":
            self._save_dew(path, max_shard_bytes)
        else:
            self._save_hf(path, format, max_shard_bytes)
        return path

    def _save_hf(self, path, family, max_shard_bytes):
        if not isinstance(self.model, CausalTransformer):
            raise TypeError(
                f"only a CausalTransformer saves as {family}; got "
                f"{type(self.model).__name__} (use format='dew')"
            )
        hf_config.check_expressible(self.model, family)
        tensors = hf_weights.hf_tensors(self.params, self.model, family)
        base = self.hf_config if self.format == family else None
        config = hf_config.to_config(self.model, family, base=base, dtype_name=_dtype_name(tensors))
        if base is None and self.end_ids:
            config["eos_token_id"] = (
                self.end_ids[0] if len(self.end_ids) == 1 else list(self.end_ids)
            )
        write_tensors(path, tensors, max_shard_bytes=max_shard_bytes)
        (path / HF_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        self._save_tokenizer(path, allow_bytes=False)

    def _save_dew(self, path, max_shard_bytes):
        name, config = models.config_of(self.model)
        flat = traverse_util.flatten_dict(self.params, sep="/")
        tensors = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
        write_tensors(path, tensors, max_shard_bytes=max_shard_bytes)
        description = {
            "format": "dew",
            "version": 1,
            "model": {"name": name, "config": config},
            "tokenizer": self._save_tokenizer(path, allow_bytes=True),
            "end_ids": list(self.end_ids),
        }
        (path / DEW_CONFIG).write_text(json.dumps(description, indent=2))

    def _save_tokenizer(self, path, *, allow_bytes: bool):
        if self.tokenizer is None:
            return None
        if isinstance(self.tokenizer, HFTokenizer):
            self.tokenizer.save(path)
            return {"kind": "hf"}
        if isinstance(self.tokenizer, ByteTokenizer) and allow_bytes:
            return {"kind": "bytes"}
        if isinstance(self.tokenizer, ByteTokenizer):  # the same ids, as a tokenizer.json
            save_byte_tokenizer(self.tokenizer, path)
            return {"kind": "hf"}
        raise TypeError(
            f"cannot save a tokenizer of type {type(self.tokenizer).__name__}; "
            f"Pretrained saves ByteTokenizer and HFTokenizer (or tokenizer=None)"
        )

    # ------------------------------------------------------------------ use

    def pipeline(self, **options):
        """A :class:`dew.sampling.TextGeneration` over this model (strings in, strings out)."""
        from dew.sampling.pipelines import TextGeneration

        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer; build TextGeneration with one")
        return TextGeneration(
            self.model,
            self.params,
            self.tokenizer,
            end_ids=self.end_ids,
            checkpoint_format=self.format,
            hf_config=self.hf_config,
            **options,
        )


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
    dtypes = {np.dtype(v.dtype).name for v in tensors.values()}
    return dtypes.pop() if len(dtypes) == 1 else "float32"
