"""Text encoders for text-conditioned diffusion: prompts in, context embeddings out.

A :class:`TextEncoder` is a token model, its parameters and its tokenizer. A
prompt is tokenized, cut or right-padded to ``max_length`` tokens, and run
through the model; the context a diffusion transformer cross-attends to is

- a :class:`dew.nn.CausalTransformer`'s final hidden states (after its output
  norm, ``return_hidden=True``), as Imagen / PixArt read a frozen language
  model's last layer: ``[batch, max_length, emb_features]``;
- any other token model's output (a :class:`dew.nn.Transformer` with
  ``out_features``): ``[batch, max_length, out_features]``.

Two ways to have one (``docs/diffusion.md``):

- **frozen, from a checkpoint**: :meth:`TextEncoder.load` reads any directory
  :class:`dew.sampling.Pretrained` reads (a Hugging Face GPT-2, Llama, Qwen2,
  Mistral checkpoint through Dew's own loaders, or a Dew checkpoint); its
  weights never change;
- **trained with the model**: a small encoder is a trained role of the
  objective; its trained parameters and the same :func:`encode_tokens` make the
  pipeline's encoder.

As in Stable Diffusion (CLIP's padded 77 tokens), padding positions are part of
the context: training and sampling see the same fixed-length sequence, so no
context mask is needed. The unconditional (guidance) context is the encoding
of the empty prompt ``""``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.sampling.checkpoint_io import formats as checkpoint_formats


def encode_tokens(module: nn.Module, params: Any, ids: jax.Array) -> jax.Array:
    """The context ``[batch, length, features]`` (float32) of token ids ``[batch, length]``
    (traceable: the objective calls it on a trained encoder's parameters)."""
    variables = {"params": params}
    if getattr(type(module), "registry_name", None) == "causal_transformer":
        _, hidden = module.apply(variables, ids, return_hidden=True)
        return hidden.astype(jnp.float32)
    return module.apply(variables, ids).astype(jnp.float32)


def context_features(module: nn.Module) -> int:
    """Width of :func:`encode_tokens`' output for ``module``."""
    if getattr(type(module), "registry_name", None) == "causal_transformer":
        return int(module.emb_features)
    features = getattr(module, "head_features", None)
    if features is None:
        features = getattr(module, "emb_features", None)
    if features is None:
        raise ValueError(
            f"cannot tell the output width of a {type(module).__name__} text encoder; use a "
            f"dew.nn.CausalTransformer or a dew.nn.Transformer"
        )
    return int(features)


@functools.lru_cache(maxsize=16)
def _compiled_encoder(module):
    return jax.jit(functools.partial(encode_tokens, module))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextEncoder:
    """A token model as a text encoder (module docstring).

    module: a :class:`dew.nn.CausalTransformer` (hidden states) or another token
      model whose output is the context.
    params: its parameters.
    tokenizer: ``encode(str) -> list[int]`` (``ByteTokenizer``, ``HFTokenizer``).
    max_length: tokens per prompt (longer prompts are cut, shorter right-padded).
    pad_id: id of the padding; None = the tokenizer's ``pad_id``, else its ``end_id``,
      else 0.
    checkpoint_format: what :meth:`save` writes: ``'dew'`` or the Hugging Face family
      the encoder was loaded from (a Hugging Face checkpoint stays one).
    hf_config: the ``config.json`` of that checkpoint.
    """

    module: Any
    params: Any
    tokenizer: Any
    max_length: int = 32
    pad_id: int | None = None
    checkpoint_format: str = "dew"
    hf_config: dict | None = None

    def __post_init__(self):
        if isinstance(self.max_length, bool) or self.max_length < 1:
            raise ValueError(f"TextEncoder.max_length must be >= 1 tokens, got {self.max_length}")
        if self.tokenizer is None:
            raise ValueError("a TextEncoder needs a tokenizer (ByteTokenizer, HFTokenizer)")
        object.__setattr__(self, "params", nn.meta.unbox(self.params))
        if self.pad_id is None:
            pad = getattr(self.tokenizer, "pad_id", None)
            pad = getattr(self.tokenizer, "end_id", None) if pad is None else pad
            object.__setattr__(self, "pad_id", 0 if pad is None else int(pad))

    @property
    def features(self) -> int:
        """Width of the context, ``context_features`` of the diffusion model."""
        return context_features(self.module)

    def tokenize(self, texts: Sequence[str]) -> np.ndarray:
        """int32 ``[len(texts), max_length]``: each prompt cut or right-padded."""
        if isinstance(texts, str):
            raise TypeError("tokenize takes a list of prompts; wrap one prompt in a list")
        ids = np.full((len(texts), self.max_length), self.pad_id, np.int32)
        for row, text in enumerate(texts):
            tokens = list(self.tokenizer.encode(text))[: self.max_length]
            ids[row, : len(tokens)] = tokens
        return ids

    def __call__(self, texts: Sequence[str]) -> jax.Array:
        """The context ``[len(texts), max_length, features]`` (float32) of ``texts``."""
        return _compiled_encoder(self.module)(self.params, jnp.asarray(self.tokenize(texts)))

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the encoder as a :class:`dew.sampling.Pretrained` checkpoint to ``path``
        (:attr:`checkpoint_format`)."""
        end_ids = checkpoint_formats.default_end_ids(self.tokenizer, self.hf_config)
        return checkpoint_formats.write(
            pathlib.Path(path),
            model=self.module,
            params=self.params,
            tokenizer=self.tokenizer,
            format=self.checkpoint_format,
            end_ids=end_ids,
            hf_config=self.hf_config,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        max_length: int = 32,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        ignore_fields: tuple[str, ...] = (),
    ) -> TextEncoder:
        """A frozen encoder from a checkpoint directory :meth:`dew.sampling.Pretrained.load`
        reads: Dew's (``dew_config.json``) or a Hugging Face causal LM (``config.json``;
        ``dtype``, ``param_dtype`` and ``ignore_fields`` as ``Pretrained.load``'s)."""
        path = pathlib.Path(path)
        if (path / checkpoint_formats.DEW_CONFIG).exists():
            fields = checkpoint_formats.read_dew(path)
        elif (path / checkpoint_formats.HF_CONFIG).exists():
            fields = checkpoint_formats.read_hf(
                path,
                dtype=dtype,
                param_dtype=param_dtype,
                use_scan=True,
                ignore_fields=ignore_fields,
            )
        else:
            raise FileNotFoundError(
                f"{path} has neither {checkpoint_formats.DEW_CONFIG} nor "
                f"{checkpoint_formats.HF_CONFIG}; TextEncoder.load takes a checkpoint directory"
            )
        if fields.get("tokenizer") is None:
            raise ValueError(
                f"{path} has no tokenizer; a text encoder needs one (tokenizer.json beside "
                f"the weights, or a Dew checkpoint saved with its tokenizer)"
            )
        return cls(
            module=fields["model"],
            params=fields["params"],
            tokenizer=fields["tokenizer"],
            max_length=max_length,
            checkpoint_format=fields["format"],
            hf_config=fields.get("hf_config"),
        )
