"""Inference tasks that wrap trained weights: call with inputs, get outputs."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from dew.nn.keywords import is_whole_number
from dew.sampling.causal.generate import generate
from dew.sampling.causal.sampling import Sampling
from dew.sampling.checkpoint_io import formats as checkpoint_formats


@dataclasses.dataclass
class TextGeneration:
    """Strings in, strings out: tokenize, :func:`generate`, decode.

    model: a causal module (``CausalTransformer``).
    params: its parameters (the EMA weights when the objective kept them).
    tokenizer: ``encode``/``decode``/``vocab_size`` (``ByteTokenizer``, ``HFTokenizer``).
    sampling: default :class:`Sampling`; greedy unless told otherwise.
    max_new_tokens: default number of new tokens.
    end_ids: ids that end a continuation; None = the tokenizer's ``end_id``.
    checkpoint_format: what :meth:`save` writes by default: ``'dew'`` or a
      Hugging Face family (``'llama'``, ``'mistral'``, ``'qwen2'``, ``'gpt2'``).
    hf_config: the source ``config.json`` when the weights came from one.
    """

    model: Any
    params: Any
    tokenizer: Any
    sampling: Sampling = dataclasses.field(default_factory=lambda: Sampling(temperature=0))
    max_new_tokens: int = 32
    end_ids: tuple[int, ...] | None = None
    checkpoint_format: str = "dew"
    hf_config: dict | None = None

    def __post_init__(self):
        if not is_whole_number(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"TextGeneration max_new_tokens must be a whole number >= 1, got "
                f"{self.max_new_tokens!r}"
            )
        if not isinstance(self.sampling, Sampling):
            raise TypeError(
                f"TextGeneration sampling must be a dew.sampling.Sampling, got "
                f"{type(self.sampling).__name__}; pass e.g. Sampling(temperature=0.7)"
            )
        checkpoint_formats.check_format(self.checkpoint_format)

    def __call__(self, text, *, max_new_tokens=None, key=None, sampling=None, num_beams=1):
        """Continue ``text`` (a string or a list of strings); returns prompt + continuation.

        max_new_tokens: None = :attr:`max_new_tokens`, capped so that the
          longest prompt still fits the model's ``max_seq_len``.
        key: needed when ``sampling`` draws (temperature > 0).
        num_beams: > 1 decodes with beam search.
        """
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        sampling = sampling or self.sampling
        if key is None:
            if not sampling.is_greedy and num_beams == 1:
                raise ValueError("sampling with temperature > 0 needs key=jax.random.key(...)")
            key = jax.random.key(0)  # unused by greedy and beam decoding
        prompts = [self.tokenizer.encode(t) for t in texts]
        # 0 is an error (generate says so), not "the default"
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        max_len = getattr(self.model, "max_seq_len", None)
        if max_new_tokens is None and max_len is not None:
            new = max(1, min(new, max_len - max(len(p) for p in prompts)))
        end_ids = self.end_ids
        if end_ids is None:
            end_ids = getattr(self.tokenizer, "end_id", None)
        out = generate(
            self.model,
            self.params,
            prompts,
            new,
            key,
            sampling=None if num_beams > 1 else sampling,
            end_ids=end_ids,
            num_beams=num_beams,
        )
        decoded = [self.tokenizer.decode(ids) for ids in out.tokens]
        return decoded[0] if single else decoded

    def save(self, path: str | os.PathLike, *, format: str | None = None):
        """Write a :class:`dew.sampling.Pretrained` checkpoint of these weights to ``path``.

        format: None = :attr:`checkpoint_format`; ``'dew'`` or a Hugging Face family.
        """
        format = format or self.checkpoint_format
        base = self.hf_config if format == self.checkpoint_format else None
        end_ids = self.end_ids
        if end_ids is None:
            end_ids = checkpoint_formats.default_end_ids(self.tokenizer, base)
        return checkpoint_formats.write(
            path,
            model=self.model,
            params=self.params,
            tokenizer=self.tokenizer,
            format=format,
            end_ids=tuple(end_ids),
            hf_config=base,
        )
