"""``Prompts``: prompt texts as left-padded token batches, for on-policy RL (GRPO, PPO)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew.data._corpus import columns
from dew.data._padding import pad_id_of, pad_left, pad_right
from dew.data.dataset import Dataset
from dew.data.records import from_records, held_out_count
from dew.data.tokenizers import ByteTokenizer


class _Prompts:
    def __init__(
        self,
        rows: dict[str, list],
        indices: np.ndarray,
        *,
        prompt_field: str,
        answer_field: str | None,
        tokenizer,
        pad_id: int,
        prompt_len: int,
        answer_len: int,
    ):
        self._rows, self._indices = rows, indices
        self._prompt_field, self._answer_field = prompt_field, answer_field
        self._tokenizer, self._pad_id = tokenizer, pad_id
        self._prompt_len, self._answer_len = prompt_len, answer_len

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = int(self._indices[index])
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
    val_fraction: share of rows (the last ones) held out for validation; 0 = none.
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
    seed: int = 0
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.prompt_len < 1 or self.answer_len < 1:
            raise ValueError(
                f"Prompts needs prompt_len and answer_len >= 1 tokens, got {self.prompt_len} "
                f"and {self.answer_len}"
            )
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"Prompts.val_fraction must be in [0, 1), got {self.val_fraction}")

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` prompts per global batch (see ``dew.data.records``)."""
        fields = [self.prompt_field] + ([self.answer_field] if self.answer_field else [])
        rows = columns(self.source, fields, what="Prompts")
        count = len(rows[self.prompt_field])
        held_out = held_out_count(count, self.val_fraction, what="Prompts")
        options = dict(
            prompt_field=self.prompt_field,
            answer_field=self.answer_field,
            tokenizer=self.tokenizer,
            pad_id=pad_id_of(self.tokenizer, self.pad_id),
            prompt_len=self.prompt_len,
            answer_len=self.answer_len,
        )
        indices = np.arange(count)
        train = _Prompts(rows, indices[: count - held_out], **options)
        val = _Prompts(rows, indices[count - held_out :], **options) if held_out else None
        return from_records(
            train,
            val,
            batch=batch,
            seed=self.seed,
            read_threads=self.read_threads,
            prefetch=self.prefetch,
            name="Prompts",
        )
