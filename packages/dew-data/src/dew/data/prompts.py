"""``Prompts``: prompt texts as left-padded token batches, for on-policy RL (GRPO, PPO)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew.data._corpus import columns
from dew.data._padding import pad_id_of, pad_left, pad_right
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.tokenizers import ByteTokenizer


class _PromptFormat:
    """Row ``r`` of a table of prompts (and answers) as left-padded ids."""

    def __init__(
        self,
        rows: dict[str, list],
        *,
        prompt_field: str,
        answer_field: str | None,
        tokenizer,
        pad_id: int,
        prompt_len: int,
        answer_len: int,
    ):
        self._rows = rows
        self._prompt_field, self._answer_field = prompt_field, answer_field
        self._tokenizer, self._pad_id = tokenizer, pad_id
        self._prompt_len, self._answer_len = prompt_len, answer_len
        self.count = len(rows[prompt_field])
        self.spec = {
            "prompt": Field((prompt_len,), np.int32),
            "prompt_mask": Field((prompt_len,), np.bool_),
        }
        if answer_field is not None:
            self.spec["answer"] = Field((answer_len,), np.int32)
            self.spec["answer_mask"] = Field((answer_len,), np.bool_)

    def example(self, row: int) -> dict[str, np.ndarray]:
        ids = self._tokenizer.encode(self._rows[self._prompt_field][row] or "")
        example = dict(
            zip(("prompt", "prompt_mask"), pad_left(ids, self._prompt_len, self._pad_id))
        )
        if self._answer_field is not None:
            answer = self._rows[self._answer_field][row]
            ids = self._tokenizer.encode("" if answer is None else str(answer))
            example["answer"], example["answer_mask"] = pad_right(
                ids, self._answer_len, self._pad_id
            )
        return example


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Prompts for objectives that sample their own completions (GRPO, PPO).

    Batch keys:

    - ``"prompt"``: int32 ``[rows, prompt_len]``, the prompt's last
      ``prompt_len`` ids, left-padded so every prompt ends in the last column
      (what ``dew.sampling``'s compiled decoding takes).
    - ``"prompt_mask"``: bool ``[rows, prompt_len]``, False on padding.
    - with ``answer_field``: ``"answer"`` int32 ``[rows, answer_len]``
      (right-padded reference answer ids, for a reward function) and
      ``"answer_mask"``.

    source: JSON-lines or parquet files (paths, directories or patterns), or a
      ``datasets.Dataset``.
    prompt_len: prompt ids kept, in tokens.
    tokenizer: encodes the texts.
    prompt_field: the field or column holding the prompt.
    answer_field: a field holding a reference answer; None = none.
    answer_len: answer ids kept, in tokens.
    pad_id: fills padding; None = ``tokenizer.pad_id`` (else its end id, else 0).
    val_fraction: share of rows held out for validation; 0 = none. Not used
      with ``val_source``.
    val_from: where the held-out rows are taken: ``"tail"`` (the last rows, the
      default) or ``"head"`` (the first).
    val_source: a separate validation table (the same kinds as ``source``),
      all of whose rows validate; None = hold out ``val_fraction`` of ``source``.
    seed: shuffle seed of the training rows.
    read_threads: Grain threads reading ahead (0 = in the caller's thread).
    prefetch: batches read ahead.
    """

    source: Any
    _: dataclasses.KW_ONLY
    prompt_len: int = 128
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    prompt_field: str = "prompt"
    answer_field: str | None = None
    answer_len: int = 32
    pad_id: int | None = None
    val_fraction: float = 0.0
    val_from: str = "tail"
    val_source: Any = None
    seed: int = 0
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.prompt_len < 1 or self.answer_len < 1:
            raise ValueError(
                f"Prompts needs prompt_len and answer_len >= 1 tokens, got {self.prompt_len} "
                f"and {self.answer_len}"
            )
        check_split("Prompts", self.val_fraction, self.val_from)

    def _format(self, source: Any, what: str) -> _PromptFormat:
        fields = [self.prompt_field] + ([self.answer_field] if self.answer_field else [])
        return _PromptFormat(
            columns(source, fields, what=what),
            prompt_field=self.prompt_field,
            answer_field=self.answer_field,
            tokenizer=self.tokenizer,
            pad_id=pad_id_of(self.tokenizer, self.pad_id),
            prompt_len=self.prompt_len,
            answer_len=self.answer_len,
        )

    def splits(self) -> tuple[Rows, Rows]:
        """The training and validation prompts, as rows (what ``dew.data.Mixture`` reads)."""
        prompts = self._format(self.source, "Prompts")
        if self.val_source is not None:
            val_prompts = self._format(self.val_source, "Prompts (val_source)")
            train = Rows(prompts, np.arange(prompts.count))
            val = Rows(val_prompts, np.arange(val_prompts.count))
        else:
            train_rows, val_rows = split_rows(
                prompts.count,
                val_fraction=self.val_fraction,
                val_from=self.val_from,
                what="Prompts",
            )
            train, val = Rows(prompts, train_rows), Rows(prompts, val_rows)
        return train, val

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` prompts per global batch (see ``dew.data.records``)."""
        return compose(*self.splits(), batch=batch, reader=self, name="Prompts")
