"""``SFTExamples``: supervised fine-tuning rows as TRL's ``SFTTrainer`` reads them.

Two kinds of row (the dataset formats of TRL):

- **prompt / completion**: ``{"prompt": "...", "completion": "..."}``. The ids
  are the prompt's (with the tokenizer's own specials, such as a BOS), the
  completion's (without) and the end id; the loss mask is True on the
  completion and the end id. Conversational rows, ``{"prompt": [messages],
  "completion": [messages]}``, are rendered with the chat template and train
  on the assistant turns of the completion.
- **messages**: ``{"messages": [{"role": ..., "content": ...}, ...]}``,
  rendered with the tokenizer's chat template (:class:`dew.data.ChatTemplate`,
  as ``transformers`` renders it) and tokenized whole without added specials
  (the template writes them); the loss mask is True on the tokens of the
  assistant turns only.

Every row is tokenized when :meth:`SFTExamples.load` runs, so a bad row is an
error naming it before anything trains. With ``packing=True`` short examples
share windows (TRL's ``packing=True``, best-fit decreasing): ``segment_ids``
number the examples of a window, so attention never crosses from one to
another, and ``positions`` restart at 0 for each. The windows are fixed once;
their order is shuffled anew each epoch, and the reader's position is
checkpointed like every other reader's (``dew.data.records``).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew.data._corpus import columns, is_hf_dataset
from dew.data._padding import pad_id_of
from dew.data._reader import Rows, check_split, compose, split_rows
from dew.data.chat_template import ChatTemplate, ChatTemplateError, special_tokens_of
from dew.data.dataset import Dataset, Field
from dew.data.records import RecordError
from dew.data.tokenizers import ByteTokenizer

logger = logging.getLogger("dew.data")

# the roles a conversation may hold, and which may follow which (system only first)
_FOLLOWS = {
    None: ("system", "developer", "user"),
    "system": ("user",),
    "developer": ("user",),
    "user": ("assistant",),
    "assistant": ("user", "tool"),
    "tool": ("tool", "assistant"),
}


def check_roles(messages: Any) -> str | None:
    """None when ``messages`` is a conversation Dew trains on, else what is wrong: a
    list of ``{"role", "content"}`` dicts, an optional system (or developer) message
    first, then user and assistant turns in alternation (tool results after an
    assistant turn, before the next), with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}"
    previous = None
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return f"message {index} is not a {{'role', 'content'}} dict: {message!r}"
        role = message["role"]
        if role not in _FOLLOWS[previous]:
            roles = [m.get("role") if isinstance(m, Mapping) else None for m in messages]
            return (
                f"the roles do not alternate: message {index} is {role!r} after "
                f"{previous!r} (roles {roles}); a conversation is an optional system message, "
                f"then user and assistant turns in turn"
            )
        previous = role
    if not any(m["role"] == "assistant" for m in messages):
        return "the conversation has no assistant turn, so nothing in it would be trained on"
    return None


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Ids of ``text`` without the tokenizer's added specials, with character offsets
    when the tokenizer gives them."""
    if hasattr(tokenizer, "encode_with_offsets"):
        return tokenizer.encode_with_offsets(text, add_special_tokens=False)
    return list(tokenizer.encode(text)), None


def _chat_ids(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """The rendered chat's ids and the mask of those inside ``spans`` (characters):
    the whole text tokenized, each id kept when its characters overlap a span (as
    ``transformers``' ``return_assistant_tokens_mask``); a tokenizer without offsets
    tokenizes the pieces between span edges one by one."""
    ids, offsets = _encode(tokenizer, text)
    if offsets is not None:
        mask = [any(end > a and start < b for a, b in spans) for start, end in offsets]
        return list(ids), mask
    edges = sorted({0, len(text), *(edge for span in spans for edge in span)})
    ids, mask = [], []
    for start, end in zip(edges, edges[1:], strict=False):
        inside = any(a <= start and end <= b for a, b in spans)
        piece = _encode(tokenizer, text[start:end])[0]
        ids.extend(piece)
        mask.extend([inside] * len(piece))
    return ids, mask


@dataclasses.dataclass(frozen=True)
class _Tokenized:
    """Every example's ids and loss mask, concatenated; example ``i`` is
    ``ids[starts[i]:starts[i + 1]]``."""

    ids: np.ndarray  # int32 [tokens]
    mask: np.ndarray  # bool [tokens]
    starts: np.ndarray  # int64 [examples + 1]
    rows: np.ndarray  # the source row of each example

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def subset(self, examples: np.ndarray) -> _Tokenized:
        """Examples ``examples`` alone, in that order."""
        pieces = [slice(self.starts[e], self.starts[e + 1]) for e in examples]
        lengths = np.asarray([p.stop - p.start for p in pieces], np.int64)
        return _Tokenized(
            ids=np.concatenate([self.ids[:0], *(self.ids[p] for p in pieces)]),
            mask=np.concatenate([self.mask[:0], *(self.mask[p] for p in pieces)]),
            starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            rows=self.rows[np.asarray(examples, np.int64)],
        )


def pack_best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Examples of ``lengths`` (each <= ``capacity``) in bins of ``capacity``: best-fit
    decreasing (TRL's ``"bfd"``), longest first, each into the fullest bin it fits,
    ties by example order. Returns each bin's examples, in the order placed."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for example in order:
        size = int(lengths[example])
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, index = free.pop(at)
            bins[index].append(example)
            if room - size > 0:
                bisect.insort(free, (room - size, index))
        else:
            bins.append([example])
            if capacity - size > 0:
                bisect.insort(free, (capacity - size, len(bins) - 1))
    return bins


class _WindowFormat:
    """Window ``w``: its examples one after another, then padding."""

    def __init__(self, tokens: _Tokenized, windows: list[list[int]], length: int, pad_id: int):
        self._tokens, self._windows = tokens, windows
        self._length, self._pad_id = length, pad_id
        self.count = len(windows)
        self.spec = {
            "text": Field((length,), np.int32),
            "loss_mask": Field((length,), np.bool_),
            "segment_ids": Field((length,), np.int32),
            "positions": Field((length,), np.int32),
        }

    def example(self, window: int) -> dict[str, np.ndarray]:
        length, starts = self._length, self._tokens.starts
        ids = np.full((length,), self._pad_id, np.int32)
        mask = np.zeros((length,), np.bool_)
        segments = np.zeros((length,), np.int32)
        positions = np.arange(length, dtype=np.int32)
        at = 0
        for segment, example in enumerate(self._windows[window], start=1):
            start, end = starts[example], starts[example + 1]
            size = end - start
            ids[at : at + size] = self._tokens.ids[start:end]
            mask[at : at + size] = self._tokens.mask[start:end]
            segments[at : at + size] = segment
            positions[at : at + size] = np.arange(size)
            at += size
        positions[at:] = np.arange(length - at)
        return {"text": ids, "loss_mask": mask, "segment_ids": segments, "positions": positions}


@dataclasses.dataclass(frozen=True)
class SFTExamples:
    """Prompt/completion or chat rows as token windows with a loss mask, for SFT.

    Batch keys, all ``[rows, seq_len + 1]`` (the model reads the first
    ``seq_len`` of a row and predicts the last ``seq_len``, as with
    :class:`dew.data.TokenWindows`):

    - ``"text"``: int32 ids; an example, or with ``packing`` several, then padding.
    - ``"loss_mask"``: bool, True on the ids trained on: the completion and its
      end id, or the assistant turns (their end-of-turn tokens included). The
      first id of an example is never True (nothing precedes it to predict it).
    - ``"segment_ids"``: int32, 1, 2, ... for the examples of a row, 0 on padding.
    - ``"positions"``: int32, each id's position in its own example (from 0).

    ``LMObjective(model, loss_mask_key="loss_mask", segment_ids_key="segment_ids",
    positions_key="positions")`` trains on it: the loss is the mean over the
    masked ids of the whole global batch, packed or not.

    source: JSON-lines or parquet files (paths, directories or patterns), or a
      ``datasets.Dataset``, with a ``messages`` column, or ``prompt`` and
      ``completion`` columns (text, or lists of messages).
    seq_len: positions the model reads; a row holds ``seq_len + 1`` ids.
    tokenizer: encodes the texts; its chat template renders conversations.
    packing: put several examples in a row (segment ids keep them apart);
      False = one example a row, right-padded.
    max_length: cut each example to its first ``max_length`` ids (TRL's
      ``max_length``, keeping the start), at most ``seq_len + 1``; None = never
      cut (an example longer than a row is an error naming it).
    messages_field, prompt_field, completion_field: the columns read.
    chat_template: the Jinja text of the chat template; None = the tokenizer's
      (:meth:`dew.data.ChatTemplate.of_tokenizer`). Only conversations need one.
    chat_template_kwargs: more variables for the template (``enable_thinking``).
    end_id: put after a text completion; None = ``tokenizer.end_id`` (none if it
      has none). Conversations end turns as their template writes them.
    pad_id: fills padding; None = ``tokenizer.pad_id`` (else its end id, else 0).
    skip_errors: drop rows that cannot be read (counted in a warning on the
      ``dew.data`` logger) instead of stopping with an error naming the row.
    val_fraction, val_from, val_source, seed, read_threads, prefetch: as for
      :class:`dew.data.PreferencePairs`; the held-out share is of the examples,
      which are then packed on their own.
    """

    source: Any
    _: dataclasses.KW_ONLY
    seq_len: int = 1024
    tokenizer: Any = dataclasses.field(default_factory=ByteTokenizer)
    packing: bool = False
    max_length: int | None = None
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    end_id: int | None = None
    pad_id: int | None = None
    skip_errors: bool = False
    val_fraction: float = 0.0
    val_from: str = "tail"
    val_source: Any = None
    seed: int = 0
    read_threads: int = 2
    prefetch: int = 4

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"SFTExamples.seq_len must be >= 1 positions, got {self.seq_len}")
        if self.max_length is not None and not 2 <= self.max_length <= self.seq_len + 1:
            raise ValueError(
                f"SFTExamples.max_length must be in [2, seq_len + 1 = {self.seq_len + 1}] ids "
                f"(a row holds seq_len + 1), got {self.max_length}; use None to never cut"
            )
        check_split("SFTExamples", self.val_fraction, self.val_from)

    @property
    def row_length(self) -> int:
        """Ids per row: ``seq_len + 1``."""
        return self.seq_len + 1

    # ------------------------------------------------------------- reading
    def _template(self) -> ChatTemplate:
        if self.chat_template is not None:
            return ChatTemplate(self.chat_template, special_tokens_of(self.tokenizer))
        return ChatTemplate.of_tokenizer(self.tokenizer)

    def _columns(self, source: Any, what: str) -> tuple[dict[str, list], str]:
        """The rows' columns and their kind, ``"messages"`` or ``"prompt"``."""
        try:
            return columns(source, [self.messages_field], what=what), "messages"
        except KeyError as missing_messages:
            fields = [self.prompt_field, self.completion_field]
            try:
                return columns(source, fields, what=what), "prompt"
            except KeyError as missing_prompt:
                # the reading that got further names the row at fault: rows that are
                # prompt/completion rows up to line 3 lack a field on line 3, not line 1
                read = [getattr(e, "at", None) for e in (missing_messages, missing_prompt)]
                if None not in read and read[0] != read[1]:
                    further, kind = (
                        (missing_prompt, f"{self.prompt_field!r} and {self.completion_field!r}")
                        if read[1] > read[0]
                        else (missing_messages, repr(self.messages_field))
                    )
                    raise KeyError(
                        f"{what}: {further.args[0]}; the rows before it have {kind}, which "
                        f"every row needs: fix or drop the row"
                    ) from None
                raise KeyError(
                    f"{what}: rows need a {self.messages_field!r} column (conversations) or "
                    f"{self.prompt_field!r} and {self.completion_field!r} columns; "
                    f"{missing_messages.args[0]}"
                ) from None

    def tokenize(self, source: Any, what: str = "SFTExamples") -> _Tokenized:
        """Every row of ``source`` tokenized, with its loss mask (errors name the row)."""
        table, kind = self._columns(source, what)
        described = _describe(source)
        count = len(next(iter(table.values())))
        # a template that is missing or does not compile is no row's fault: built first
        chats = kind == "messages" or any(isinstance(p, list) for p in table[self.prompt_field])
        template = self._template() if chats else None
        ids, masks, rows, skipped = [], [], [], 0
        for row in range(count):
            try:
                if kind == "messages":
                    example = self._chat_example(table[self.messages_field][row], 0, template)
                else:
                    example = self._prompt_example(
                        table[self.prompt_field][row], table[self.completion_field][row], template
                    )
                example = self._fit(*example)
            except (ValueError, TypeError) as error:
                record = f"row {row} of {described}"
                if not self.skip_errors:
                    raise RecordError(
                        record, f"{error}; fix or drop the row, or pass skip_errors=True"
                    ) from None
                skipped += 1
                logger.warning(
                    "%s: skipped %s (%s); %d skipped so far", what, record, error, skipped
                )
                continue
            ids.append(example[0])
            masks.append(example[1])
            rows.append(row)
        if not ids:
            raise ValueError(f"{what}: no row of {described} is readable ({skipped} skipped)")
        lengths = np.asarray([len(i) for i in ids], np.int64)
        return _Tokenized(
            ids=np.concatenate([np.asarray(i, np.int32) for i in ids]),
            mask=np.concatenate([np.asarray(m, np.bool_) for m in masks]),
            starts=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            rows=np.asarray(rows, np.int64),
        )

    def _prompt_example(self, prompt, completion, template: ChatTemplate | None):
        if isinstance(prompt, list) and isinstance(completion, list):
            return self._chat_example(prompt + completion, len(prompt), template)
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ValueError(
                f"prompt and completion must both be text or both lists of messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}"
            )
        end_id = self.end_id if self.end_id is not None else getattr(self.tokenizer, "end_id", None)
        prompt_ids = list(self.tokenizer.encode(prompt))
        completion_ids = list(_encode(self.tokenizer, completion)[0])
        completion_ids += [] if end_id is None else [int(end_id)]
        if not completion_ids:
            raise ValueError("the completion is empty and the tokenizer has no end id")
        mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
        return prompt_ids + completion_ids, mask

    def _chat_example(self, messages, first: int, template: ChatTemplate):
        """A conversation's ids and the mask of its assistant turns from ``first`` on."""
        problem = check_roles(messages)
        if problem is not None:
            raise ValueError(problem)
        if first and not any(m["role"] == "assistant" for m in messages[first:]):
            raise ValueError("the completion has no assistant turn to train on")
        text, spans = template.assistant_spans(messages, first=first, **self.chat_template_kwargs)
        if not spans:
            raise ChatTemplateError("the chat template marked no assistant text")
        return _chat_ids(self.tokenizer, text, spans)

    def _fit(self, ids: list[int], mask: list[bool]) -> tuple[list[int], list[bool]]:
        """Cut to ``max_length``; an example longer than a row, or with nothing left
        to train on, is an error."""
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
        elif len(ids) > self.row_length:
            what = "a packed window" if self.packing else "a row"
            raise ValueError(
                f"its example has {len(ids)} ids, longer than {what} of seq_len + 1 = "
                f"{self.row_length}; set max_length={self.row_length} to cut examples "
                f"(keeping their start), or a larger seq_len"
            )
        mask = [False, *mask[1:]]  # the first id has nothing before it to predict it
        if not any(mask):
            cut = f" after cutting to max_length={self.max_length}" if self.max_length else ""
            raise ValueError(
                f"its completion is empty{cut} (no id left to train on; the example has "
                f"{len(ids)} ids); use a larger max_length or seq_len, or a shorter prompt"
            )
        return ids, mask

    def _windows(self, tokens: _Tokenized) -> _WindowFormat:
        if self.packing:
            windows = pack_best_fit(tokens.lengths.tolist(), self.row_length)
        else:
            windows = [[example] for example in range(len(tokens.rows))]
        return _WindowFormat(
            tokens, windows, self.row_length, pad_id_of(self.tokenizer, self.pad_id)
        )

    def splits(self) -> tuple[Rows, Rows | None]:
        """The training and validation rows (what ``dew.data.Mixture`` reads)."""
        tokens = self.tokenize(self.source)
        if self.val_source is not None:
            train = self._windows(tokens)
            val = self._windows(self.tokenize(self.val_source, "SFTExamples (val_source)"))
        else:
            train_rows, val_rows = split_rows(
                len(tokens.rows),
                val_fraction=self.val_fraction,
                val_from=self.val_from,
                what="SFTExamples",
            )
            train = self._windows(tokens.subset(train_rows))
            val = self._windows(tokens.subset(val_rows)) if len(val_rows) else None
        return (
            Rows(train, np.arange(train.count)),
            None if val is None else Rows(val, np.arange(val.count)),
        )

    def load(self, *, batch: int) -> Dataset:
        """A :class:`Dataset` of ``batch`` rows per global batch (see ``dew.data.records``)."""
        train, val = self.splits()
        if self.packing and 0 < len(train) < batch:
            raise ValueError(
                f"SFTExamples: packing made {len(train)} training window(s) of "
                f"{self.row_length} ids, fewer than the global batch of {batch} rows; use "
                f"batch <= {len(train)}, more data, or a smaller seq_len"
            )
        return compose(train, val, batch=batch, reader=self, name="SFTExamples")


def _describe(source: Any) -> str:
    """A source as an error names it."""
    if is_hf_dataset(source):
        return "the datasets.Dataset"
    if isinstance(source, str | os.PathLike):
        return repr(os.fspath(source))
    return repr([os.fspath(s) for s in source])
