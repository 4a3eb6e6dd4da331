"""Whole documents packed into windows, with segment ids and positions (document-aware
packing, as MaxText and Levanter pack pretraining text).

Documents (each with its end id) are placed in corpus order: a window takes the
next document while it fits, then is padded; a document longer than a window is
cut into window-sized pieces (``"split"``, each piece its own segment), left out
(``"drop"``) or an error (``"error"``). In a window, ``segment_ids`` number its
documents 1, 2, ... (0 on padding) and ``positions`` count from 0 in each, so
attention and rotary positions restart at every document, and the language-model
loss counts no target across documents or on padding.
"""

from __future__ import annotations

import numpy as np

from dew.data.dataset import Field

LONG_DOCUMENTS = ("error", "split", "drop")


def pieces(ends: np.ndarray, length: int, long_documents: str) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, sizes)`` of the pieces documents ending at ``ends`` become in windows
    of ``length`` ids (int64, corpus order)."""
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    sizes = (ends - starts).astype(np.int64)
    long = np.flatnonzero(sizes > length)
    if long.size and long_documents == "error":
        first = int(long[0])
        raise ValueError(
            f"TokenWindows(documents='pack'): document {first} of the corpus has "
            f"{int(sizes[first])} ids (its end id included), more than a window of seq_len + 1 "
            f"= {length} ({long.size} document(s) are that long); pass long_documents='split' "
            f"to cut them into windows (each piece its own segment, positions restarting) or "
            f"'drop' to leave them out, or use a larger seq_len"
        )
    if long_documents == "drop":
        keep = sizes <= length
        return starts[keep], sizes[keep]
    count = -(-sizes // length)  # pieces per document
    first = np.repeat(np.cumsum(count) - count, count)
    within = np.arange(int(count.sum())) - first
    piece_starts = np.repeat(starts, count) + within * length
    piece_sizes = np.minimum(np.repeat(starts + sizes, count) - piece_starts, length)
    return piece_starts, piece_sizes


def pack_in_order(sizes: np.ndarray, length: int) -> np.ndarray:
    """First piece of each window (int64 ``[windows + 1]``, the last = ``len(sizes)``):
    a window takes the next piece while it fits."""
    firsts = [0]
    room = length
    for index, size in enumerate(sizes.tolist()):
        if size > room:
            firsts.append(index)
            room = length
        room -= size
    firsts.append(len(sizes))
    return np.asarray(firsts, np.int64)


class DocumentWindows:
    """Window ``w``: its documents one after another, then padding with ``pad_id``."""

    def __init__(self, ids, ends: np.ndarray, seq_len: int, *, long_documents: str, pad_id: int):
        self._ids, self._pad_id = ids, pad_id
        self._length = seq_len + 1
        self._starts, self._sizes = pieces(ends, self._length, long_documents)
        self._firsts = pack_in_order(self._sizes, self._length)
        self.count = len(self._firsts) - 1
        self.spec = {
            key: Field((self._length,), np.int32) for key in ("text", "segment_ids", "positions")
        }

    def example(self, window: int) -> dict[str, np.ndarray]:
        return {key: rows[0] for key, rows in self.examples(np.asarray([window])).items()}

    def examples(self, windows: np.ndarray) -> dict[str, np.ndarray]:
        """Windows ``windows`` in one gather: int32 ``[len(windows), seq_len + 1]`` each.

        Row by row, a window is its pieces then its padding, so the rows laid end to
        end are runs ("entries": each piece, then each row's padding) whose values
        ``numpy.repeat`` spreads over their lengths.
        """
        windows = np.asarray(windows, np.int64)
        rows, length = len(windows), self._length
        firsts, lasts = self._firsts[windows], self._firsts[windows + 1]
        counts = lasts - firsts  # pieces per window
        row_start = np.cumsum(counts) - counts
        piece = np.repeat(firsts - row_start, counts) + np.arange(int(counts.sum()))
        within = np.arange(len(piece)) - np.repeat(row_start, counts)  # piece of its row
        sizes = self._sizes[piece]
        row_of_piece = np.repeat(np.arange(rows), counts)
        used = np.bincount(row_of_piece, weights=sizes, minlength=rows).astype(np.int64)
        # entries: row r's pieces at row_start[r] + r + (0, 1, ...), its padding after them
        at_piece = row_start[row_of_piece] + row_of_piece + within
        at_padding = row_start + counts + np.arange(rows)
        entries = len(piece) + rows
        entry_sizes = np.empty(entries, np.int64)
        entry_sizes[at_piece], entry_sizes[at_padding] = sizes, length - used
        segment = np.zeros(entries, np.int32)
        segment[at_piece] = within + 1
        base = np.zeros(entries, np.int64)
        base[at_piece] = self._starts[piece]
        flat_start = np.cumsum(entry_sizes) - entry_sizes
        offsets = np.arange(rows * length) - np.repeat(flat_start, entry_sizes)
        real = np.repeat(segment > 0, entry_sizes)
        text = np.where(
            real, self._ids[np.where(real, np.repeat(base, entry_sizes) + offsets, 0)], self._pad_id
        )
        shape = (rows, length)
        return {
            "text": text.astype(np.int32).reshape(shape),
            "segment_ids": np.repeat(segment, entry_sizes).reshape(shape),
            "positions": offsets.astype(np.int32).reshape(shape),
        }
