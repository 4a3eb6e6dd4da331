"""``PreferencePairs``: (prompt, chosen, rejected) texts as padded token batches, for DPO."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dew.data._corpus import columns
from dew.data._padding import pad_id_of
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.dataset import Dataset, Field
from dew.data.tokenizers import ByteTokenizer


def completion_ids(tokenizer, text: str, end_id: int | None) -> list[int]:
    """A completion's ids followed by the end id (None = no end id)."""
    ids = list(tokenizer.encode(text or ""))
    return ids if end_id is None else ids + [end_id]


def pack(
    prompt: list[int], completion: list[int], *, prompt_len: int, completion_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompt (its last ``prompt_len`` ids) then completion (its first ``completion_len``)
    then padding: ``(ids, prompt_mask, completion_mask)``, each of
    ``[prompt_len + completion_len]``."""
    prompt = prompt[-prompt_len:] if prompt_len else []
    completion = completion[:completion_len]
    length = prompt_len + completion_len
    ids = np.full((length,), pad_id, np.int32)
    ids[: len(prompt)] = prompt
    ids[len(prompt) : len(prompt) + len(completion)] = completion
    positions = np.arange(length)
    prompt_mask = positions < len(prompt)
    completion_mask = (positions >= len(prompt)) & (positions < len(prompt) + len(completion))
    return ids, prompt_mask, completion_mask


class _PairFormat:
    """Row ``r`` of a table of (prompt, chosen, rejected) texts as two packed sequences."""

    def __init__(
        self,
        rows: dict[str, list],
        fields: tuple[str, str, str],
        *,
        tokenizer,
        end_id,
        pad_id,
        prompt_len,
        completion_len,
    ):
        self._rows, self._fields = rows, fields
        self._tokenizer, self._end_id, self._pad_id = tokenizer, end_id, pad_id
        self._prompt_len, self._completion_len = prompt_len, completion_len
        self.count = len(rows[fields[0]])
        length = (prompt_len + completion_len,)
        self.spec = {
            "chosen": Field(length, np.int32),
            "chosen_mask": Field(length, np.bool_),
            "rejected": Field(length, np.int32),
            "rejected_mask": Field(length, np.bool_),
            "prompt_mask": Field(length, np.bool_),
        }

    def example(self, row: int) -> dict[str, np.ndarray]:
        prompt_field, chosen_field, rejected_field = self._fields
        prompt = list(self._tokenizer.encode(self._rows[prompt_field][row] or ""))
        example = {}
        for name, field in (("chosen", chosen_field), ("rejected", rejected_field)):
            ids, prompt_mask, mask = pack(
                prompt,
                completion_ids(self._tokenizer, self._rows[field][row], self._end_id),
                prompt_len=self._prompt_len,
                completion_len=self._completion_len,
                pad_id=self._pad_id,
            )
            example[name], example[f"{name}_mask"] = ids, mask
        example["prompt_mask"] = prompt_mask
        return example


@dataclasses.dataclass(frozen=True)
class PreferencePairs:
    """Preference pairs: a prompt with a preferred and a rejected completion.

    Each row becomes two sequences of ``prompt_len + completion_len`` ids: the
    prompt (cut to its last ``prompt_len`` ids) immediately followed by the
    completion and the end id (cut to ``completion_len`` ids; a cut completion
    loses its end id), then padding. Batch keys, all ``[rows, prompt_len +
    completion_len]``:

    - ``"chosen"``, ``"rejected"``: int32 ids.
    - ``"chosen_mask"``, ``"rejected_mask"``: bool, True on the completion's
      ids (end id included): the positions whose log-probabilities DPO sums.
    - ``"prompt_mask"``: bool, True on the prompt's ids (the same columns in
      both sequences).

    The sequences are right-padded, so a causal model reads them without an
    attention mask. ``LMObjective(model, seq_len=prompt_len + completion_len
    - 1, text_key="chosen", loss_mask_key="chosen_mask")`` fine-tunes on the
    chosen completions (SFT) from the same batches.

    source: JSON-lines or parquet files (paths, directories or patterns), or a
      ``datasets.Dataset``.
    prompt_len: prompt ids kept, in tokens.
    completion_len: completion ids kept (end id included), in tokens.
    tokenizer: encodes the texts (``encode``, ``end_id``, ``pad_id``).
    prompt_field, chosen_field, rejected_field: the fields or columns read.
    end_id: put after each completion; None = ``tokenizer.end_id`` (none if it has none).
    pad_id: fills the rest; None = ``tokenizer.pad_id`` (else its end id, else 0).
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
    completion_len: int = 128
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    end_id: int | None = None
    pad_id: int | None = None
    val_fraction: float = 0.0
    val_from: str = "tail"
    val_source: Any = None
    seed: int = 0
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.prompt_len < 0 or self.completion_len < 1:
            raise ValueError(
                f"PreferencePairs needs prompt_len >= 0 and completion_len >= 1 tokens, got "
                f"{self.prompt_len} and {self.completion_len}"
            )
        check_split("PreferencePairs", self.val_fraction, self.val_from)

    def _format(self, source: Any, what: str) -> _PairFormat:
        fields = (self.prompt_field, self.chosen_field, self.rejected_field)
        end_id = self.end_id if self.end_id is not None else getattr(self.tokenizer, "end_id", None)
        return _PairFormat(
            columns(source, fields, what=what),
            fields,
            tokenizer=self.tokenizer,
            end_id=end_id,
            pad_id=pad_id_of(self.tokenizer, self.pad_id),
            prompt_len=self.prompt_len,
            completion_len=self.completion_len,
        )

    def splits(self) -> tuple[Rows, Rows]:
        """The training and validation pairs, as rows (what ``dew.data.Mixture`` reads)."""
        pairs = self._format(self.source, "PreferencePairs")
        if self.val_source is not None:
            val_pairs = self._format(self.val_source, "PreferencePairs (val_source)")
            train = Rows(pairs, np.arange(pairs.count))
            val = Rows(val_pairs, np.arange(val_pairs.count))
        else:
            train_rows, val_rows = split_rows(
                pairs.count,
                val_fraction=self.val_fraction,
                val_from=self.val_from,
                what="PreferencePairs",
            )
            train, val = Rows(pairs, train_rows), Rows(pairs, val_rows)
        return train, val

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` pairs per global batch (see ``dew.data.records``)."""
        return compose(*self.splits(), batch=batch, reader=self, name="PreferencePairs")
