"""TokenWindows(documents="pack"): whole documents per window against a plain-Python
packer, long documents split, dropped or refused, and the default unchanged."""

import numpy as np
import pytest

from dew.data import Mixture, Partition, TokenWindows

DOCS = ["alpha", "a much longer document here", "b", "the third one", "xyz" * 3, "end."]
END = 256


def reference_windows(docs, length, long_documents):
    """Greedy in-order packing written plainly: (text, segment_ids, positions) rows."""
    pieces = []
    for doc in docs:
        ids = list(doc.encode()) + [END]
        if len(ids) > length and long_documents == "drop":
            continue
        pieces += [ids[i : i + length] for i in range(0, len(ids), length)]
    windows, current = [], []
    for piece in pieces:
        if sum(map(len, current)) + len(piece) > length:
            windows.append(current)
            current = []
        current.append(piece)
    windows.append(current)
    rows = []
    for window in windows:
        text, segments, positions = [], [], []
        for segment, piece in enumerate(window, start=1):
            text += piece
            segments += [segment] * len(piece)
            positions += list(range(len(piece)))
        pad = length - len(text)
        rows.append((text + [END] * pad, segments + [0] * pad, positions + list(range(pad))))
    return rows


def read_all(data):
    """Every training window of the first epoch, in window order (sorted by text)."""
    iterator = data.train(Partition())
    batches = [next(iterator) for _ in range(-(-data.records // data.batch))]
    keys = ("text", "segment_ids", "positions")
    rows = [
        tuple(tuple(batch[k][r].tolist()) for k in keys)
        for batch in batches
        for r in range(data.batch)
    ]
    return sorted(set(rows))


@pytest.mark.parametrize("long_documents", ["split", "drop"])
def test_packed_windows_match_a_plain_packer(tmp_path, write_jsonl, long_documents):
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    reader = TokenWindows(
        tmp_path / "d.jsonl",
        seq_len=15,
        documents="pack",
        long_documents=long_documents,
        val_fraction=0,
        cache_dir=tmp_path / "c",
        read_threads=0,
    )
    data = reader.load(batch=2)
    expected = reference_windows(DOCS, 16, long_documents)
    assert data.records == len(expected)
    assert read_all(data) == sorted(set(map(lambda r: tuple(map(tuple, r)), expected)))
    assert set(data.spec) == {"text", "segment_ids", "positions"}


def test_a_document_longer_than_a_window_is_an_error_naming_the_option(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    reader = TokenWindows(
        tmp_path / "d.jsonl", seq_len=15, documents="pack", cache_dir=tmp_path / "c"
    )
    with pytest.raises(ValueError, match=r"document 1 of the corpus has 28 ids.*'split'.*'drop'"):
        reader.load(batch=2)
    with pytest.raises(ValueError, match="documents must be one of"):
        TokenWindows(tmp_path / "d.jsonl", seq_len=15, documents="packed")
    with pytest.raises(ValueError, match="long_documents must be one of"):
        TokenWindows(tmp_path / "d.jsonl", seq_len=15, long_documents="cut")


def test_the_default_stream_and_a_packed_mixture(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in DOCS])
    stream = TokenWindows(tmp_path / "d.jsonl", seq_len=8, cache_dir=tmp_path / "c")
    assert set(stream.load(batch=2).spec) == {"text"}
    packed = TokenWindows(
        tmp_path / "d.jsonl",
        seq_len=31,
        documents="pack",
        val_fraction=0,
        cache_dir=tmp_path / "c",
    )
    mixed = Mixture({"a": packed, "b": packed}, {"a": 1, "b": 1}, read_threads=0).load(batch=2)
    batch = next(mixed.train(Partition()))
    assert set(batch) == {"text", "segment_ids", "positions"}
    # Every row restarts its positions where its segment changes.
    for segments, positions in zip(batch["segment_ids"], batch["positions"], strict=True):
        starts = np.flatnonzero(np.diff(segments) != 0) + 1
        assert positions[0] == 0 and np.all(positions[starts] == 0)
