"""Prompts before decoding: checked on the host, then left-padded into one batch.

Prompts are left-padded to a multiple of :data:`PROMPT_BUCKET` positions, so
prompts of nearby lengths share one compiled program, and the batch is
filled up with empty rows to a multiple of the devices it is split over (see
:func:`row_multiple`), so every sharding constraint on the batch divides.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from dew.nn import axes
from dew.nn.keywords import is_whole_number
from dew.nn.shards import shard_count

# Prompts are left-padded to a multiple of this many positions.
PROMPT_BUCKET = 8


def row_multiple() -> int:
    """How many ways the current mesh and logical-axis rules split the batch (1 outside a mesh).

    Under ``jax.set_mesh`` with ``nn.logical_axis_rules`` (as inside
    ``Trainer.fit``) the model constrains its activations to a batch split
    over these devices; a batch that does not divide over them makes XLA
    replicate and re-split whole activations at every step.
    """
    return shard_count(axes.BATCH)


def pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, *, multiple: int = 1, rows: int = 1
):
    """Left-pad prompts to one length, rounded up to ``multiple``; add empty rows
    (all padding) until the number of rows is a multiple of ``rows``.

    Returns ``(tokens [batch, prompt], mask [batch, prompt])``; mask is False on
    padding. The decoders treat a row without a real token as finished from
    the start: it produces nothing and keeps no loop running.
    """
    longest = max(len(p) for p in prompts)
    longest = -(-longest // multiple) * multiple
    batch = -(-len(prompts) // rows) * rows
    tokens = np.full((batch, longest), pad_id, np.int32)
    mask = np.zeros((batch, longest), bool)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, longest - len(prompt) :] = prompt
            mask[row, longest - len(prompt) :] = True
    return tokens, mask


def check_prompts(
    model, prompts, max_new_tokens: int, *, pad_id: int = 0, end_ids: Sequence[int] = ()
) -> list[list[int]]:
    """Validate prompts before compiling; returns them as lists of ints.

    Raises when a prompt is empty or not a list of ids, ``max_new_tokens`` is
    not a whole number >= 1, a token id (or ``pad_id``, or an id of
    ``end_ids``) lies outside ``0..vocab_size-1``, a prompt is longer than the
    model's ``max_seq_len``, or a prompt plus ``max_new_tokens`` would overrun it.
    """
    if not is_whole_number(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens must be a whole number >= 1 (new tokens per row), got "
            f"{max_new_tokens!r} ({type(max_new_tokens).__name__}); pass e.g. "
            f"max_new_tokens={max(1, _rounded(max_new_tokens))}"
        )
    if not is_whole_number(pad_id):
        raise TypeError(f"pad_id must be a whole number (a token id), got {pad_id!r}")
    if isinstance(prompts, np.ndarray | jax.Array):
        prompts = np.asarray(prompts).tolist()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], str)):
        raise TypeError(
            "generate takes token ids; encode text with a tokenizer (or use "
            "TextGeneration, which takes strings)"
        )
    if not prompts:
        raise ValueError("generate needs at least one prompt; got an empty list")
    if isinstance(prompts[0], int | np.integer):
        raise TypeError(
            "prompt must be a list of prompts (one list of ids per row); "
            "wrap a single prompt as [ids]"
        )
    rows = [[int(t) for t in p] for p in prompts]
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        largest = max(max(r) for r in rows)
        smallest = min(min(r) for r in rows)
        if largest >= vocab:
            row = next(i for i, r in enumerate(rows) if largest in r)
            raise ValueError(
                f"prompt {row} holds token id {largest}, the largest id in the batch, but the "
                f"model's vocab_size is {vocab}; ids must be in 0..{vocab - 1} (check the "
                f"tokenizer matches the model)"
            )
        if smallest < 0:
            raise ValueError(
                f"prompt token id {smallest} is negative; ids must be in 0..{vocab - 1}"
            )
        if not 0 <= pad_id < vocab:
            raise ValueError(
                f"pad_id {pad_id} is outside the model's vocabulary 0..{vocab - 1}; pass a "
                f"pad_id the model knows (Pretrained.pad_id of a Hugging Face checkpoint, its "
                f"config.json pad_token_id, or any id below {vocab}: padding is masked out)"
            )
        outside = [e for e in end_ids if not 0 <= e < vocab]
        if outside:
            raise ValueError(
                f"end id(s) {outside} of end_ids={list(end_ids)} are outside the model's "
                f"vocabulary 0..{vocab - 1}: the model can never produce them, so no row "
                f"would end. Pass the model's own end ids (Pretrained.end_ids, a Hugging Face "
                f"checkpoint's config.json / generation_config.json eos_token_id) or the "
                f"tokenizer that matches the model"
            )
    max_len = getattr(model, "max_seq_len", None)
    if max_len is not None:
        longest = max(len(r) for r in rows)
        if longest > max_len:
            raise ValueError(
                f"prompt of {longest} tokens is longer than the model's max_seq_len "
                f"{max_len}; shorten it"
            )
        if longest + max_new_tokens > max_len:
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = "
                f"{longest + max_new_tokens} overruns max_seq_len {max_len}; use "
                f"max_new_tokens <= {max_len - longest}"
            )
    return rows


def end_id_tuple(end_ids: Sequence[int] | int | None) -> tuple[int, ...]:
    """``None``, one id or several ids, as a tuple of ints."""
    if end_ids is None:
        return ()
    if is_whole_number(end_ids):
        return (int(end_ids),)
    if isinstance(end_ids, str) or not all(is_whole_number(e) for e in end_ids):
        raise TypeError(
            f"end_ids must be a token id or a sequence of token ids (whole numbers), got "
            f"{end_ids!r}; encode an end string with the tokenizer first"
        )
    return tuple(int(e) for e in end_ids)


def _rounded(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1
