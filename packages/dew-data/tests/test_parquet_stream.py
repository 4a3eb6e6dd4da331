"""ParquetStream: a datasets repository's parquet shards streamed into windows; checked
against the corpus read whole with pyarrow and cut with numpy, resumed exactly, shared
between processes by row group, with only one row group's text held."""

import re

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from dew.data import ByteTokenizer, ParquetStream, Partition  # noqa: E402

SHARDS, GROUPS, ROWS = 3, 4, 5  # 3 shards of 4 row groups of 5 rows


def document(shard, row):
    return f"<s{shard} r{row:02d}>" + "abcdefghij"[: (shard * 7 + row) % 10]


@pytest.fixture
def repository(tmp_path):
    """The Hub's parquet layout: data/train-0000i-of-00003.parquet, plus a test split."""
    data = tmp_path / "data"
    data.mkdir()
    for shard in range(SHARDS):
        table = pa.table(
            {
                "text": [document(shard, r) for r in range(GROUPS * ROWS)],
                "id": list(range(GROUPS * ROWS)),
            }
        )
        pq.write_table(
            table, data / f"train-{shard:05d}-of-{SHARDS:05d}.parquet", row_group_size=ROWS
        )
    pq.write_table(pa.table({"text": ["held out"]}), data / "test-00000-of-00001.parquet")
    return tmp_path


def windows(iterator, batches):
    return np.concatenate([next(iterator)["text"] for _ in range(batches)])


def test_windows_are_the_corpus_cut_in_order(repository):
    reader = ParquetStream(repository, seq_len=16, shuffle=False)
    # independent: every train file read whole, the texts' bytes joined with end ids
    files = sorted((repository / "data").glob("train-*.parquet"))
    ids = []
    for path in files:
        for text in pq.read_table(path)["text"].to_pylist():
            ids.extend(text.encode())
            ids.append(ByteTokenizer.end_id)
    ids = np.asarray(ids)
    count = (len(ids) - 1) // 16
    expected = ids[np.arange(count)[:, None] * 16 + np.arange(17)]
    got = windows(iter(reader.load(batch=4).train(Partition())), count // 4)
    np.testing.assert_array_equal(got, expected[: len(got)])
    assert reader.files() == [str(f) for f in files]


def test_resume_is_exact_at_every_point(repository):
    dataset = ParquetStream(repository, seq_len=8, seed=3).load(batch=2)
    whole = windows(dataset.train(Partition()), 60)  # past an epoch (~95 windows of 8)
    for stop in (1, 7, 23, 48):
        first = dataset.train(Partition())
        head = windows(first, stop)
        state = first.get_state()
        resumed = dataset.train(Partition())
        resumed.set_state(state)
        np.testing.assert_array_equal(np.concatenate([head, windows(resumed, 60 - stop)]), whole)


def test_epochs_reshuffle_row_groups(repository):
    def first_markers(seed):
        iterator = ParquetStream(repository, seq_len=8, seed=seed).load(batch=1).train(Partition())
        return bytes(windows(iterator, 12).reshape(-1).clip(0, 255).astype(np.uint8))

    assert first_markers(0) != first_markers(1)


def test_each_process_reads_only_its_row_groups(repository, monkeypatch):
    read = []
    original = pq.ParquetFile.read_row_group

    def recorded(self, group, **kwargs):
        table = original(self, group, **kwargs)
        read.append((int(table["text"][0].as_py()[2]), group))  # the shard, from its text
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", recorded)
    dataset = ParquetStream(repository, seq_len=32, seed=1).load(batch=4)
    seen = []
    for index in range(2):
        read.clear()
        iterator = dataset.train(Partition(index, 2))
        # within the first epoch: 6 row groups of 5 documents of 11 to 20 bytes
        text = bytes(windows(iterator, 6).reshape(-1).clip(0, 255).astype(np.uint8))
        groups = {(int(s), int(r) // ROWS) for s, r in re.findall(rb"<s(\d) r(\d\d)>", text)}
        assert groups <= set(read) and len(set(read)) == len(read) <= SHARDS * GROUPS // 2
        seen.append(set(read))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {(s, g) for s in range(SHARDS) for g in range(GROUPS)}
    state = dataset.train(Partition(0, 2)).get_state()
    with pytest.raises(ValueError, match=r"partition \[0, 2\].*this run reads partition \[1, 2\]"):
        dataset.train(Partition(1, 2)).set_state(state)


PROXY_POOLS = []


def test_only_the_current_row_group_is_held(tmp_path):
    """pyarrow's peak allocation while streaming two epochs (a proxy of its memory pool,
    transient buffers included) stays at a few row groups of the text column, a small
    part of the corpus; the other column (10x wider) is never read."""
    text = "x" * 2000
    for shard in range(4):
        table = pa.table({"text": [text] * 96, "other": [b"y" * 20000] * 96})
        pq.write_table(table, tmp_path / f"train-{shard}.parquet", row_group_size=8)
    corpus = 4 * 96 * len(text)
    group = 8 * len(text)  # one row group of the text column
    default = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(default)
    # kept for the process: buffers allocated through it may be freed after the test
    # (a freed pool there crashes the next allocation's free)
    PROXY_POOLS.append(proxy)
    pa.set_memory_pool(proxy)
    try:
        iterator = ParquetStream(tmp_path, seq_len=1000).load(batch=1).train(Partition())
        for _ in range(2 * corpus // 1000):  # two epochs
            next(iterator)
        del iterator
    finally:
        pa.set_memory_pool(default)
    # a group is read through the pool (the measure sees it); a row group of the other
    # column alone would be 10 groups of text
    assert group <= proxy.max_memory() <= 4 * group < corpus / 10


def test_bad_input_is_named(repository, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory.*missing"):
        ParquetStream(tmp_path / "missing", seq_len=8).load(batch=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .parquet file"):
        ParquetStream(tmp_path / "empty", seq_len=8).load(batch=1)
    with pytest.raises(FileNotFoundError, match=r"no parquet file of split 'validation'.*test-"):
        ParquetStream(repository, seq_len=8, split="validation").load(batch=1)
    with pytest.raises(KeyError, match=r"no column 'content'; its columns are \['text', 'id'\]"):
        ParquetStream(repository, seq_len=8, field="content").load(batch=1)
    with pytest.raises(ValueError, match="12 row groups cannot give each of 16 processes"):
        ParquetStream(repository, seq_len=8).load(batch=16).train(Partition(0, 16))
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        ParquetStream(repository, seq_len=0)
