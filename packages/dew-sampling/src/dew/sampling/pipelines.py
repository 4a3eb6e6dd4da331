"""Inference tasks that wrap trained weights: call with inputs, get outputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dew.sampling.generate import generate
from dew.sampling.sampling import Sampling


@dataclasses.dataclass
class TextGeneration:
    """Strings in, strings out: tokenize, :func:`generate`, decode.

    model: a causal module (``CausalTransformer``).
    params: its parameters (the EMA weights when the objective kept them).
    tokenizer: ``encode``/``decode``/``vocab_size`` (``ByteTokenizer``, ``HFTokenizer``).
    sampling: default :class:`Sampling`; greedy unless told otherwise.
    max_new_tokens: default number of new tokens.
    """

    model: Any
    params: Any
    tokenizer: Any
    sampling: Sampling = dataclasses.field(default_factory=lambda: Sampling(temperature=0))
    max_new_tokens: int = 32

    def __call__(self, text, *, max_new_tokens=None, key=None, sampling=None):
        """Continue ``text`` (a string or a list of strings); returns prompt + continuation."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        sampling = sampling or self.sampling
        if key is None:
            if not sampling.is_greedy:
                raise ValueError("sampling with temperature > 0 needs key=jax.random.key(...)")
            key = jax.random.key(0)  # unused by greedy decoding
        end_id = getattr(self.tokenizer, "end_id", None)
        out = generate(
            self.model,
            self.params,
            [self.tokenizer.encode(t) for t in texts],
            max_new_tokens or self.max_new_tokens,
            key,
            sampling=sampling,
            end_ids=end_id,
        )
        decoded = [self.tokenizer.decode(ids) for ids in out.tokens]
        return decoded[0] if single else decoded
