"""Pretrained checkpoints: load a model, its weights and its tokenizer; save them back.

Two formats, told apart by the file that describes the model (see
:mod:`dew.sampling.checkpoint_io.formats`): a Hugging Face checkpoint
(``config.json``; the families of :mod:`dew.nn.hf`) and Dew's own
(``dew_config.json``). ``save`` writes the format a checkpoint came in, so a
Hugging Face checkpoint stays one.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dew.nn.keywords import is_whole_number
from dew.nn.lora import base_module, fold, lora_of
from dew.sampling import token_diffusion
from dew.sampling.causal.prompts import end_id_tuple
from dew.sampling.causal.text_generation import TextGeneration
from dew.sampling.checkpoint_io import formats
from dew.sampling.diffusion import pipelines as diffusion_pipelines


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pretrained:
    """A model with its weights (and tokenizer, for a language model), and the format
    it came in.

    model: the module: :class:`dew.nn.CausalTransformer` for the Hugging Face
      causal-LM families, :class:`dew.nn.ViT` for ``'ijepa'`` and ``'vjepa2'`` (transformers'
      ``IJepaModel``: ``model.apply({'params': params}, images)`` gives its
      ``last_hidden_state``).
    params: its parameter tree (unboxed; numpy or jax arrays).
    tokenizer: ``ByteTokenizer``, ``HFTokenizer`` or None.
    format: what :meth:`save` writes: ``'dew'`` or a Hugging Face family
      (``'llama'``, ``'mistral'``, ``'qwen2'``, ``'gpt2'``, ``'mixtral'``, ``'qwen2_moe'``,
      ``'qwen3_moe'``, ``'ijepa'``, ``'vjepa2'``; ``dew.nn.hf.names()``).
    hf_config: the ``config.json`` a Hugging Face checkpoint came with; the
      fields Dew ignores (token ids, ...) are written back by :meth:`save`.
    end_ids: token ids that end a generation; None = the tokenizer's ``end_id``
      and ``eos_token_id`` of ``generation_config.json`` and ``config.json`` (one
      id or a list each), so a Hugging Face checkpoint without a tokenizer still
      knows its end ids.
    pad_id: the token id that fills padding; None = ``pad_token_id`` of
      ``generation_config.json`` or ``config.json`` (either may be null), else the
      tokenizer's ``pad_id``, else the first end id; None when none of them exists.
    generation_config: the ``generation_config.json`` a Hugging Face checkpoint came
      with (its token ids and generation defaults); written back by :meth:`save`.
    diffusion: a diffusion model's sampling setup (a Dew checkpoint's ``"diffusion"``
      section, :mod:`dew.sampling.diffusion.pipelines`); None = none, or a denoiser
      (``DiT``) sampled as DiT was trained.
    pipeline_parts: pipeline fields read beside a diffusion model (a text-conditioned
      one's ``text_encoder`` and ``null_context``); None = none.
    lora: a :class:`dew.nn.lora.LoRA` when ``params`` also hold its adapters (a LoRA run's
      ``state.params``; a LoRA module given as ``model`` sets it):
      :meth:`save` folds them into the kernels (``W + alpha/rank * A B``, the
      source's own format), :meth:`save_adapter` writes them as a PEFT directory.
      ``dataclasses.replace(pretrained, params=..., lora=lora)`` makes one from a load.
    """

    model: Any
    params: Any
    tokenizer: Any = None
    format: str = "dew"
    hf_config: dict[str, Any] | None = None
    end_ids: tuple[int, ...] | None = None
    pad_id: int | None = None
    generation_config: dict[str, Any] | None = None
    diffusion: dict[str, Any] | None = None
    pipeline_parts: dict[str, Any] | None = None
    lora: Any = None

    def __post_init__(self):
        formats.check_format(self.format)
        object.__setattr__(self, "params", nn.meta.unbox(self.params))
        if lora_of(self.model) is not None:  # keep the plain module; the config says LoRA
            object.__setattr__(self, "lora", self.lora or lora_of(self.model))
            object.__setattr__(self, "model", base_module(self.model))
        if self.end_ids is None:
            ids = formats.default_end_ids(self.tokenizer, self.hf_config, self.generation_config)
            object.__setattr__(self, "end_ids", ids)
        else:
            object.__setattr__(self, "end_ids", end_id_tuple(self.end_ids))
        if self.pad_id is None:
            pad = formats.default_pad_id(
                self.tokenizer, self.hf_config, self.generation_config, self.end_ids
            )
            object.__setattr__(self, "pad_id", pad)
        elif not is_whole_number(self.pad_id):
            raise TypeError(
                f"pad_id must be a token id (a whole number) or None, got {self.pad_id!r}"
            )

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
          unknown fields are an error otherwise (see :mod:`dew.nn.hf.fields`).
        """
        path = pathlib.Path(path)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is not a directory; Pretrained.load takes the checkpoint directory"
            )
        if (path / formats.DEW_CONFIG).exists():
            fields = formats.read_dew(path)
            if fields.get("diffusion") is not None:
                fields["pipeline_parts"] = diffusion_pipelines.read_pipeline_parts(
                    fields["diffusion"], path
                )
            return cls(**fields)
        if (path / formats.HF_CONFIG).exists():
            return cls(
                **formats.read_hf(
                    path,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    use_scan=use_scan,
                    ignore_fields=ignore_fields,
                )
            )
        steps = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name.isdigit())
        hint = (
            f"; it holds step directories {steps[:5]}, as a training run's Checkpoints "
            f"directory does: rebuild its model with dew.train.load_model({str(path)!r}) "
            f"and save it with Pretrained(model=..., params=...).save(...)"
            if steps
            else ""
        )
        raise FileNotFoundError(
            f"{path} has neither {formats.DEW_CONFIG} (a Dew checkpoint) nor "
            f"{formats.HF_CONFIG} (a Hugging Face checkpoint){hint}"
        )

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
        if token_diffusion.is_token_diffusion(self.diffusion):
            if format != "dew":
                raise ValueError(
                    f"a token-diffusion checkpoint is saved in Dew's format (its sampling "
                    f"setup has no Hugging Face form), not {format!r}; use format='dew'"
                )
            return self.pipeline().save(path)
        if self._is_diffusion:
            return self.pipeline().save(path, format=format)
        return formats.write(
            path,
            model=self.model,
            params=self.merged_params,
            tokenizer=self.tokenizer,
            format=format,
            end_ids=self.end_ids,
            hf_config=self.hf_config if format == self.format else None,
            max_shard_bytes=max_shard_bytes,
            generation_config=self.generation_config if format == self.format else None,
        )

    @property
    def merged_params(self):
        """The plain module's parameters: :attr:`params` with any LoRA adapters folded in."""
        return self.params if self.lora is None else fold(self.params, self.lora)

    def save_adapter(
        self, path: str | os.PathLike, *, base_model_name_or_path: str | None = None
    ) -> pathlib.Path:
        """Write the LoRA adapters as a PEFT adapter directory (``adapter_config.json``
        and ``adapter_model.safetensors``, PEFT's names and ``[rank, in]`` /
        ``[out, rank]`` layouts) that ``peft.PeftModel.from_pretrained`` loads onto
        the transformers model of this checkpoint.

        base_model_name_or_path: recorded in ``adapter_config.json`` (where the base
          model is); None = none.
        """
        if self.lora is None:
            raise ValueError(
                "this Pretrained has no LoRA adapters (lora=None); pass lora= with params "
                "that hold them, e.g. dataclasses.replace(pretrained, params=state.params, "
                "lora=lora)"
            )
        if self.format == "dew":
            raise ValueError(
                "save_adapter writes PEFT's format, keyed by a Hugging Face family's tensor "
                f"names; this checkpoint's format is 'dew'. Use one of {formats.hf.names()}"
            )
        return formats.write_peft(
            path,
            model=self.model,
            params=self.params,
            lora=self.lora,
            family=self.format,
            base_model_name_or_path=base_model_name_or_path,
        )

    @property
    def _is_diffusion(self) -> bool:
        registry_name = getattr(type(self.model), "registry_name", None)
        return self.diffusion is not None or registry_name in ("dit", "video_dit")

    def pipeline(self, **options):
        """The model's inference task: a :class:`dew.sampling.TextGeneration` for a
        language model (strings in, strings out); for a diffusion model the
        ``ClassToImage`` / ``ClassToVideo`` / ``TextToImage`` / ``TextToVideo`` its
        ``diffusion`` section describes (a diffusers DiT: ``ClassToImage`` as DiT was
        trained, :func:`dew.sampling.diffusion_pipelines.default_description`).
        ``options`` override pipeline fields (``num_steps=``, ``guidance=``, ...).
        A masked or block diffusion language model (``diffusion`` task
        ``'token_diffusion'``): its :class:`dew.sampling.TokenDiffusionGeneration`."""
        if token_diffusion.is_token_diffusion(self.diffusion):
            return token_diffusion.TokenDiffusionGeneration.from_pretrained(self, **options)
        if self._is_diffusion:
            description = self.diffusion or diffusion_pipelines.default_description(self.model)
            options = {**(self.pipeline_parts or {}), **options}
            return diffusion_pipelines.pipeline_from_description(
                description,
                model=self.model,
                params=self.params,
                checkpoint_format=self.format,
                hf_config=self.hf_config,
                **options,
            )
        if getattr(type(self.model), "registry_name", None) == "vit":
            raise ValueError(
                "this checkpoint is an image encoder (dew.nn.ViT), not a language model; "
                "call model.apply({'params': params}, images) for its features"
            )
        tokenizer = options.pop("tokenizer", self.tokenizer)
        if tokenizer is None:
            raise ValueError(
                f"this {self.format} checkpoint has no tokenizer (no tokenizer.json beside its "
                f"weights), and TextGeneration turns strings into ids with one: pass the "
                f"model's own, pipeline(tokenizer=dew.data.HFTokenizer(directory with its "
                f"tokenizer.json)), or generate from token ids with dew.sampling.generate("
                f"pretrained.model, pretrained.params, ids, max_new_tokens, key, "
                f"end_ids={self.end_ids}, pad_id={self.pad_id}) (this checkpoint's end and pad "
                f"ids, read from its config)"
            )
        return TextGeneration(
            self.model,
            self.merged_params,
            tokenizer,
            end_ids=self.end_ids,
            checkpoint_format=self.format,
            hf_config=self.hf_config,
            **options,
        )
