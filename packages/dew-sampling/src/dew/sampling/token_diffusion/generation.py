"""The text-generation task of masked and block diffusion language models, and its
checkpoint: :class:`TokenDiffusionGeneration` (strings in, strings out), saved as a
Dew checkpoint whose ``"diffusion"`` section says how it samples, which
:meth:`dew.sampling.Pretrained.load` recognises."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.keywords import is_whole_number
from dew.sampling.checkpoint_io import formats as checkpoint_formats
from dew.sampling.token_diffusion.samplers import (
    MaskedSampler,
    MaskSchedule,
    check_prompt_fits,
    sample_blocks,
    sample_masked,
)


@dataclasses.dataclass
class TokenDiffusionGeneration:
    """Strings in, strings out, by masked diffusion (``block_size=None``, MDLM) or
    block diffusion (BD3-LM): the inference task of
    :class:`~dew.objectives.diffusion.masked.MaskedDiffusionObjective` and
    :class:`~dew.objectives.diffusion.block.BlockDiffusionObjective`.

    model, params: a :class:`dew.nn.Transformer` denoiser and its weights.
    tokenizer: ``encode`` / ``decode`` (``ByteTokenizer``, ``HFTokenizer``).
    mask_id: the absorbing state's id.
    schedule: the :class:`MaskSchedule` it was trained with.
    length: tokens per sample, prompt included (at most the model's ``max_seq_len``).
    sampler: :class:`MaskedSampler` (steps, first-hitting, cache, top-p); per block
      for block diffusion.
    block_size: None = MDLM (every token denoised together); else blocks of that
      many tokens, left to right, with a clean-block KV cache (``use_kv_cache``).
    end_id: block diffusion stops once every row has it (variable length), and the
      text ends before it; None = the tokenizer's ``end_id``.
    """

    model: Any
    params: Any
    tokenizer: Any
    mask_id: int
    schedule: MaskSchedule = MaskSchedule()
    length: int = 64
    sampler: MaskedSampler = MaskedSampler()
    block_size: int | None = None
    use_kv_cache: bool = True
    end_id: int | None = None

    def __post_init__(self):
        if not is_whole_number(self.length) or self.length < 1:
            raise ValueError(f"length={self.length!r} must be a whole number >= 1 tokens")
        max_len = getattr(self.model, "max_seq_len", None)
        if max_len is not None and self.length > max_len:
            raise ValueError(
                f"length {self.length} is more than the model's max_seq_len {max_len}; "
                f"sample at most {max_len} tokens"
            )
        if self.block_size is not None and self.length % self.block_size:
            raise ValueError(
                f"length {self.length} is not a multiple of block_size {self.block_size}; "
                f"use a length of k * {self.block_size}"
            )
        if self.end_id is None:
            self.end_id = getattr(self.tokenizer, "end_id", None)
        self._compiled = {}

    def sample_ids(self, prompt: Sequence[Sequence[int]] | np.ndarray, key: jax.Array):
        """Token ids ``[rows, length]`` (numpy) continuing each prompt (rows of equal
        length; ``[rows, 0]`` for unconditional samples)."""
        prompt = np.asarray(prompt, np.int32).reshape(len(prompt), -1)
        check_prompt_fits(prompt.shape[1], self.length, what="TokenDiffusionGeneration")
        masked = self.length - prompt.shape[1]
        if self.block_size is None:
            self.sampler.check_masked(masked)
        else:
            self.sampler.check_masked(min(masked, self.block_size), where=" of a block")
        if (prompt == self.mask_id).any():
            raise ValueError(f"the prompt holds the mask id {self.mask_id}; prompts are clean text")
        shape = prompt.shape
        if shape not in self._compiled:
            self._compiled[shape] = jax.jit(self._run)
        return np.asarray(self._compiled[shape](self.params, jnp.asarray(prompt), key))

    def _run(self, params, prompt, key):
        if self.block_size is not None:
            tokens, _, _ = sample_blocks(
                self.model,
                params,
                prompt,
                key=key,
                mask_id=self.mask_id,
                block_size=self.block_size,
                length=self.length,
                schedule=self.schedule,
                sampler=self.sampler,
                use_kv_cache=self.use_kv_cache,
                end_id=self.end_id,
            )
            return tokens
        tokens = jnp.full((prompt.shape[0], self.length), self.mask_id, jnp.int32)
        tokens = tokens.at[:, : prompt.shape[1]].set(prompt)
        timed = getattr(self.model, "time_conditioning", False)

        def denoise(z, t):
            extra = {"time": t} if timed else {}
            return self.model.apply({"params": params}, z, **extra)

        out, _ = sample_masked(
            denoise,
            tokens,
            key=key,
            mask_id=self.mask_id,
            schedule=self.schedule,
            sampler=dataclasses.replace(
                self.sampler, use_cache=self.sampler.use_cache and not timed
            ),
        )
        return out

    def __call__(self, text: str | Sequence[str] = "", *, key: jax.Array, num: int = 1):
        """Samples continuing ``text`` (one string: ``num`` samples of it; a list: one
        each, the prompts of one tokenized length). Text ends before ``end_id``."""
        texts = [text] * num if isinstance(text, str) else list(text)
        prompts = [self.tokenizer.encode(t) if t else [] for t in texts]
        if len({len(p) for p in prompts}) > 1:
            raise ValueError(
                f"the prompts tokenize to different lengths {sorted({len(p) for p in prompts})}; "
                f"sample prompts of one length together"
            )
        ids = self.sample_ids(np.asarray(prompts, np.int32).reshape(len(prompts), -1), key)
        out = []
        for row in ids.tolist():
            if self.end_id is not None and self.end_id in row[len(prompts[0]) :]:
                row = row[: row.index(self.end_id, len(prompts[0]))]
            out.append(self.tokenizer.decode([i for i in row if i != self.mask_id]))
        return out[0] if isinstance(text, str) and num == 1 else out

    def description(self) -> dict[str, Any]:
        """The ``"diffusion"`` section of a Dew checkpoint of this task."""
        return {
            "task": "token_diffusion",
            "mask_id": int(self.mask_id),
            "schedule": self.schedule.to_json(),
            "length": int(self.length),
            "num_steps": int(self.sampler.num_steps),
            "first_hitting": bool(self.sampler.first_hitting),
            "use_cache": bool(self.sampler.use_cache),
            "block_size": self.block_size,
            "use_kv_cache": bool(self.use_kv_cache),
        }

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """A Dew checkpoint (weights, model config, tokenizer, this task's settings)
        that :meth:`load` reads back."""
        end = () if self.end_id is None else (int(self.end_id),)
        return checkpoint_formats.write(
            pathlib.Path(path),
            model=self.model,
            params=self.params,
            tokenizer=self.tokenizer,
            format="dew",
            end_ids=end,
            diffusion=self.description(),
        )

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides) -> TokenDiffusionGeneration:
        """The task :meth:`save` wrote; ``overrides`` replace fields (``length=``, ...).
        ``dew.sampling.Pretrained.load(path).pipeline()`` gives the same task."""
        path = pathlib.Path(path)
        if not (path / checkpoint_formats.DEW_CONFIG).exists():
            raise ValueError(
                f"{path} is not a token-diffusion checkpoint (it has no "
                f"{checkpoint_formats.DEW_CONFIG}); load it with dew.sampling.Pretrained"
            )
        # the checkpoint's fields, read as Pretrained.load reads a Dew checkpoint
        # (dew.sampling.Pretrained dispatches to this class: it is not imported here)
        loaded = types.SimpleNamespace(**checkpoint_formats.read_dew(path))
        if not is_token_diffusion(loaded.diffusion):
            raise ValueError(
                f"{path} is not a token-diffusion checkpoint (its diffusion section is "
                f"{loaded.diffusion or 'absent'}); load it with dew.sampling.Pretrained"
            )
        return cls.from_pretrained(loaded, **overrides)

    @classmethod
    def from_pretrained(cls, loaded, **overrides) -> TokenDiffusionGeneration:
        """The task a loaded :class:`dew.sampling.Pretrained` describes (its
        ``diffusion`` section, as :meth:`save` wrote it)."""
        described = loaded.diffusion
        sampler = MaskedSampler(
            num_steps=described["num_steps"],
            first_hitting=described["first_hitting"],
            use_cache=described.get("use_cache", True),
        )
        fields = dict(
            model=loaded.model,
            params=loaded.params,
            tokenizer=loaded.tokenizer,
            mask_id=described["mask_id"],
            schedule=MaskSchedule(**described["schedule"]),
            length=described["length"],
            sampler=sampler,
            block_size=described["block_size"],
            use_kv_cache=described.get("use_kv_cache", True),
            end_id=loaded.end_ids[0] if loaded.end_ids else None,
        )
        return cls(**{**fields, **overrides})


def is_token_diffusion(description: dict[str, Any] | None) -> bool:
    """Whether a checkpoint's ``"diffusion"`` section describes a
    :class:`TokenDiffusionGeneration`."""
    return bool(description) and description.get("task") == "token_diffusion"
