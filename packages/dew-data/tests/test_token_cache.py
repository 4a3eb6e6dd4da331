"""The token cache in shards: shards read as one stream, tokenization that logs its
progress and resumes after an interruption, resident memory bounded on a corpus
larger than the limit, and two processes each reading only their share."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dew.data import ByteTokenizer, TokenWindows

DOCS = [f"document {i}: " + "words " * (i % 7) for i in range(200)]


def reference_ids(docs, end_id=256):
    return np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8), end_id) for d in docs])


def write_corpus(path, docs):
    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def test_shards_read_as_one_stream(tmp_path):
    corpus = write_corpus(tmp_path / "d.jsonl", DOCS)
    sharded = TokenWindows(corpus, seq_len=16, shard_tokens=100, cache_dir=tmp_path / "a")
    whole = TokenWindows(corpus, seq_len=16, cache_dir=tmp_path / "b")
    ids = sharded.tokens()
    meta = json.loads((tmp_path / "a" / os.listdir(tmp_path / "a")[0] / "meta.json").read_text())
    assert len(meta["shards"]) > 10 and meta["documents"] == len(DOCS)
    np.testing.assert_array_equal(ids, reference_ids(DOCS))
    np.testing.assert_array_equal(ids.document_ends(), np.cumsum([len(d) + 1 for d in DOCS]))
    # windows that straddle shards read the same as from one shard
    positions = np.arange(0, len(ids) - 17, 13)[:, None] + np.arange(17)
    np.testing.assert_array_equal(ids[positions], whole.tokens()[positions])


class Interrupting:
    """The byte tokenizer (its ids and fingerprint), counting the documents it encodes
    and interrupted at one of them."""

    def __init__(self, fail_at=None):
        self.bytes, self.encoded, self.fail_at = ByteTokenizer(), 0, fail_at
        self.vocab_size, self.end_id = self.bytes.vocab_size, self.bytes.end_id

    def fingerprint(self):
        return self.bytes.fingerprint()

    def encode(self, text):
        if self.encoded == self.fail_at:
            raise KeyboardInterrupt
        self.encoded += 1
        return self.bytes.encode(text)


def test_an_interrupted_tokenization_resumes_after_its_last_shard(tmp_path, caplog, monkeypatch):
    # documents are encoded 512 at a time; one at a time here, so shards finish first
    monkeypatch.setattr("dew.data._cache._DOCUMENTS_PER_CHUNK", 1)
    corpus = write_corpus(tmp_path / "d.jsonl", DOCS)
    first = Interrupting(fail_at=150)
    reader = TokenWindows(corpus, seq_len=16, shard_tokens=400, cache_dir=tmp_path / "c")
    caplog.set_level(logging.INFO, logger="dew.data")
    with pytest.raises(KeyboardInterrupt):
        TokenWindows(
            corpus, seq_len=16, shard_tokens=400, tokenizer=first, cache_dir=tmp_path / "c"
        ).tokens()
    progress = [r.getMessage() for r in caplog.records if "tokenized" in r.getMessage()]
    assert progress and "ids in" in progress[-1]
    directory = tmp_path / "c" / os.listdir(tmp_path / "c")[0]
    written = json.loads((directory / "progress.json").read_text())["shards"]
    done = sum(s["documents"] for s in written)
    assert 0 < done < 150 and not (directory / "meta.json").exists()
    second = Interrupting()
    ids = TokenWindows(
        corpus, seq_len=16, shard_tokens=400, tokenizer=second, cache_dir=tmp_path / "c"
    ).tokens()
    assert second.encoded == len(DOCS) - done  # only what the finished shards lacked
    assert any("resuming tokenization after" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(ids, reference_ids(DOCS))
    np.testing.assert_array_equal(reader.tokens(), ids)  # the same cache, complete


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import numpy as np
    from dew.data import Partition, TokenWindows, _cache

    corpus, cache, index, count, steps, open_shards = sys.argv[1:7]
    _cache.OPEN_SHARDS = int(open_shards)
    read = [0]
    getitem = _cache.TokenIds.__getitem__

    def counted(self, positions):
        out = getitem(self, positions)
        read[0] += out.nbytes
        return out

    _cache.TokenIds.__getitem__ = counted
    reader = TokenWindows(
        corpus, seq_len=255, shard_tokens=1 << 18, val_fraction=0, cache_dir=cache,
        read_threads=0, prefetch=0,
    )
    data = reader.load(batch=64)  # tokenized by the parent: this only opens the cache
    iterator = data.train(Partition(int(index), int(count)))

    def resident():  # bytes of this process in memory now (Linux)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    checksum = int(next(iterator)["text"].astype(np.int64).sum())  # imports done
    before, peak = resident(), 0
    for _ in range(int(steps) - 1):
        checksum += int(next(iterator)["text"].astype(np.int64).sum())
        peak = max(peak, resident())
    print(json.dumps({"grown_bytes": peak - before, "bytes_read": read[0], "checksum": checksum}))
    """
)

MIB = 1 << 20


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """A 16 MiB cache: 2,048 documents of 4,095 letters (8 Mi uint16 ids with the end
    ids) in 32 shards of 512 KiB, tokenized once."""
    directory = tmp_path_factory.mktemp("big")
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    text = letters[np.random.default_rng(0).integers(0, len(letters), (2048, 4095))]
    write_corpus(directory / "big.jsonl", [row.tobytes().decode() for row in text])
    reader = TokenWindows(
        directory / "big.jsonl", seq_len=255, shard_tokens=1 << 18, cache_dir=directory / "c"
    )
    assert len(reader.tokens()) == 8 * MIB
    return directory / "big.jsonl", directory / "c"


def start_child(tmp_path, big_corpus, *args):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, (*big_corpus, *args))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def result_of(child):
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_reading_a_corpus_larger_than_the_limit_keeps_memory_bounded(tmp_path, big_corpus):
    """An epoch of every window of a 16 MiB corpus grows the resident memory by less than
    a 6 MiB limit; mapping every shard at once (what the bound prevents) does not."""
    steps = 8 * MIB // 255 // 64  # every window once
    bounded = result_of(start_child(tmp_path, big_corpus, 0, 1, steps, 4))
    assert bounded["bytes_read"] == steps * 64 * 256 * 2  # every id of every window, ~16 MiB
    assert bounded["grown_bytes"] < 6 * MIB, bounded
    unbounded = result_of(start_child(tmp_path, big_corpus, 0, 1, steps, 10**6))
    assert unbounded["grown_bytes"] > 10 * MIB, unbounded


def test_two_processes_each_read_only_their_share(tmp_path, big_corpus):
    steps = 40
    one = result_of(start_child(tmp_path, big_corpus, 0, 1, steps, 4))
    children = [start_child(tmp_path, big_corpus, p, 2, steps, 4) for p in range(2)]
    shares = [result_of(child) for child in children]
    for share in shares:  # 32 of the 64 windows of 256 uint16 ids in each batch
        assert share["bytes_read"] == steps * 32 * 256 * 2 == one["bytes_read"] // 2
    assert shares[0]["checksum"] + shares[1]["checksum"] == one["checksum"]
    assert shares[0]["checksum"] != shares[1]["checksum"]
