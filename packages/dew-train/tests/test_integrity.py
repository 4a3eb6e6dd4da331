"""The checkpoint checksums (dew.train._integrity) on host arrays: xxh3-128-v1
(what a save records) against the xxhash library on the bytes, wsum64-v1 against
Python integers, and what each detects (every flipped bit, every pair of flipped
bits, zeroed runs, swapped blocks and shards, truncation), each a change to the
array's bytes; wsum64-v1 and crc32 records of earlier checkpoints still verify.
No Orbax and no compiling: the checkpoint round trips are in test_checkpoints.py."""

from __future__ import annotations

import json
import zlib

import ml_dtypes
import numpy as np
import pytest

from dew.train import _integrity
from dew.train._integrity import (
    ChecksumMismatchError,
    read_recorded,
    verify,
    wsum64,
    xxh3_128,
)

MASK = (1 << 64) - 1
ROW = _integrity._COLUMNS * 8  # bytes in one row of the matrix the words are seen as
BLOCK = ROW * _integrity._BLOCK_ROWS


def python_wsum64(data: bytes) -> str:
    """The definition, in Python integers: little-endian 64-bit words w_k
    (the last zero-padded), k from 1; sum w_k, sum k*w_k and the same of the
    upper 32 bits of each word, mod 2**64."""
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    upper = [w >> 32 for w in words]
    sums = (
        sum(words),
        sum(k * w for k, w in enumerate(words, 1)),
        sum(upper),
        sum(k * w for k, w in enumerate(upper, 1)),
    )
    return "".join(f"{s & MASK:016x}" for s in sums)


@pytest.fixture(params=[xxh3_128, wsum64], ids=["xxh3-128-v1", "wsum64-v1"])
def algorithm(request):
    """What a save records (xxh3-128-v1) and what earlier versions recorded."""
    return request.param


def sample(nbytes: int, seed: int = 0) -> np.ndarray:
    """float32 numbers spread like weights and Adam moments (bytes: nbytes)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(nbytes // 4) * np.exp(rng.uniform(-12, 2, nbytes // 4))
    return x.astype(np.float32)


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, 7, 8, 9, ROW - 8, ROW, ROW + 3, BLOCK, BLOCK + ROW + 5, 3 * BLOCK + 12345],
)
def test_wsum64_matches_its_definition_in_python_integers(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert wsum64(data) == python_wsum64(data.tobytes())


def test_wsum64_reads_any_dtype_and_layout_as_its_c_order_bytes():
    rng = np.random.default_rng(1)
    weights = rng.standard_normal((300, 70)).astype(np.float32)
    for array in (
        weights,
        weights.T,  # not contiguous: C order of the transposed array
        weights.astype(ml_dtypes.bfloat16),
        weights.astype(np.float64)[:, :3],
        rng.integers(-128, 127, 1001, dtype=np.int8),
        np.float32(3.5),
        np.zeros((0, 4), np.float32),
    ):
        assert wsum64(array) == python_wsum64(np.ascontiguousarray(array).tobytes())


def changed(array: np.ndarray, edit) -> np.ndarray:
    data = array.copy().reshape(-1).view(np.uint8)
    edit(data)
    assert not np.array_equal(data, array.reshape(-1).view(np.uint8)), "the edit changes the bytes"
    return data


def test_every_single_bit_flip_changes_it(algorithm):
    """All 8192 bits of a 1 KiB array, then 3,000 random bits of one that
    spans blocks, rows and a tail."""
    rng = np.random.default_rng(2)
    small = sample(1024)
    saved = algorithm(small)
    for bit in range(small.nbytes * 8):
        data = small.copy().view(np.uint8)
        data[bit // 8] ^= 1 << (bit % 8)
        assert algorithm(data) != saved, bit
    big = sample(2 * BLOCK + 3 * ROW + 36)
    saved = algorithm(big)
    for bit in rng.integers(0, big.nbytes * 8, 3000):
        data = big.copy().view(np.uint8)
        data[bit // 8] ^= 1 << (bit % 8)
        assert algorithm(data) != saved, bit


def test_every_pair_of_flipped_bits_tried_changes_it(algorithm):
    """The pairs a plain position-weighted sum mod 2**64 misses (the same bit,
    top bits, words an even or power-of-two distance apart; one bit set and
    one cleared, or both set), then 3,000 random pairs."""
    rng = np.random.default_rng(3)
    array = sample(2 * BLOCK + 3 * ROW + 40)  # whole words
    n = array.nbytes // 8
    for bit in (63, 62, 56, 33, 32, 31, 7, 0):
        mask = np.uint64(1 << bit)
        for distance in (1, 2, 4, 6, 1024, 2**14, n - 1):
            for start in rng.integers(0, n - distance, 3):
                a, b = int(start), int(start + distance)
                for b_before in (1, 0):  # opposite directions, then the same
                    base = array.copy()
                    words = base.view("<u8")
                    words[a] &= ~mask
                    words[b] = words[b] | mask if b_before else words[b] & ~mask
                    data = base.copy()
                    data.view("<u8")[[a, b]] ^= mask
                    assert algorithm(data) != algorithm(base), (bit, distance, a, b_before)
    saved = algorithm(array)
    for first, second in rng.integers(0, array.nbytes * 8, (3000, 2)):
        if first == second:
            continue
        data = array.copy().view(np.uint8)
        data[first // 8] ^= 1 << (first % 8)
        data[second // 8] ^= 1 << (second % 8)
        assert algorithm(data) != saved, (first, second)


def test_any_change_within_two_words_changes_it(algorithm):
    """2,000 pairs of words at random distances set to random values, and
    2,000 runs of 1 to 9 bytes (at most two words) set to random bytes."""
    rng = np.random.default_rng(6)
    array = sample(2 * BLOCK + 3 * ROW + 40)
    saved = algorithm(array)
    n = array.nbytes // 8
    for _ in range(2000):
        data = array.copy()
        where = rng.choice(n, 2, replace=False)
        data.view("<u8")[where] = rng.integers(0, 2**64, 2, dtype=np.uint64)
        if not np.array_equal(data.view(np.uint8), array.view(np.uint8)):
            assert algorithm(data) != saved, where
    for length in rng.integers(1, 10, 2000):
        start = int(rng.integers(0, array.nbytes - length))
        data = array.copy().view(np.uint8)
        data[start : start + length] = rng.integers(0, 256, length, dtype=np.uint8)
        if not np.array_equal(data, array.view(np.uint8)):
            assert algorithm(data) != saved, (start, length)


def test_zeroed_runs_change_it(algorithm):
    """1,000 zeroed 64-byte runs and 1,000 of 1 to 4,096 bytes at random,
    unaligned offsets (where they change the bytes)."""
    rng = np.random.default_rng(4)
    array = sample(2 * BLOCK + 3 * ROW + 36)
    saved = algorithm(array)
    for length in [64] * 1000 + list(rng.integers(1, 4097, 1000)):
        start = int(rng.integers(0, array.nbytes - length))
        region = array.view(np.uint8)[start : start + length]
        if not region.any():
            continue

        def zero(data, start=start, length=length):
            data[start : start + length] = 0

        assert algorithm(changed(array, zero)) != saved, (start, length)


def test_swapped_blocks_and_truncation_change_it(algorithm):
    rng = np.random.default_rng(5)
    array = sample(2 * BLOCK + 3 * ROW + 36)
    saved = algorithm(array)
    for length in (8, 64, 4096, ROW, 3 * ROW + 24):
        for _ in range(50):
            a, b = sorted(rng.integers(0, array.nbytes - length, 2))
            if b - a < length:
                continue

            def swap(data, a=a, b=b, length=length):
                first = data[a : a + length].copy()
                data[a : a + length] = data[b : b + length]
                data[b : b + length] = first

            assert algorithm(changed(array, swap)) != saved, (a, b, length)
    for kept in (0, 1, 4096, array.nbytes // 2, array.nbytes - 4):  # zeros after a truncation

        def truncate(data, kept=kept):
            data[kept:] = 0

        assert algorithm(changed(array, truncate)) != saved, kept


def write_record(path, algorithm, arrays):
    (path / "checksums").mkdir()
    record = {"algorithm": algorithm, "arrays": arrays}
    (path / "checksums" / "process_0-of-1.json").write_text(json.dumps(record))


def test_swapped_shards_are_caught_by_their_index(tmp_path):
    w = sample(4096).reshape(8, 128)
    top, bottom = w[:4], w[4:]
    write_record(
        tmp_path,
        _integrity.ALGORITHM,
        {"params/w": {"[0:4, 0:128]": xxh3_128(top), "[4:8, 0:128]": xxh3_128(bottom)}},
    )
    recorded = read_recorded(str(tmp_path))
    assert verify({"params": {"w": w}}, recorded) == 2
    swapped = np.concatenate([bottom, top])
    with pytest.raises(ChecksumMismatchError, match=r"array 'params/w' \(shard \[0:4, 0:128\]\)"):
        verify({"params": {"w": swapped}}, recorded)


def test_a_crc32_record_of_an_earlier_checkpoint_still_verifies(tmp_path):
    """Checkpoints written before wsum64-v1 record zlib.crc32; they verify
    against it, and a change is reported with it."""
    w = sample(4096).reshape(8, 128)
    write_record(tmp_path, "crc32", {"params/w": {"[0:8, 0:128]": zlib.crc32(w.tobytes())}})
    recorded = read_recorded(str(tmp_path))
    assert verify({"params": {"w": w}}, recorded) == 1
    flipped = changed(w, lambda data: data.__setitem__(100, data[100] ^ 1))
    flipped = flipped.view(np.float32).reshape(w.shape)
    with pytest.raises(ChecksumMismatchError) as caught:
        verify({"params": {"w": flipped}}, recorded)
    assert str(caught.value) == (
        f"array 'params/w' (shard [0:8, 0:128]) does not match the checksum saved with it "
        f"(crc32 {zlib.crc32(w.tobytes()):#010x} saved, {zlib.crc32(flipped.tobytes()):#010x} "
        f"read back)"
    )


def test_an_unknown_algorithm_is_refused_by_name(tmp_path):
    write_record(tmp_path, "sha999", {})
    with pytest.raises(
        ValueError, match=r"uses checksum 'sha999'.*knows \['crc32', 'wsum64-v1', 'xxh3-128-v1'\]"
    ):
        read_recorded(str(tmp_path))


def test_xxh3_128_is_xxhash_of_the_little_endian_c_order_bytes():
    """Any dtype and layout: the bytes of the C-order copy, little-endian (a
    big-endian array gives the same checksum as its little-endian equal)."""
    import xxhash

    w = sample(4096).reshape(8, 128)
    assert xxh3_128(w) == xxhash.xxh3_128_hexdigest(w.tobytes())
    assert xxh3_128(w.T) == xxhash.xxh3_128_hexdigest(np.ascontiguousarray(w.T).tobytes())
    assert xxh3_128(w.astype(">f4")) == xxh3_128(w)
    bf16 = w.astype(ml_dtypes.bfloat16)
    assert xxh3_128(bf16) == xxhash.xxh3_128_hexdigest(bf16.tobytes())
    assert len(xxh3_128(np.zeros((), np.int32))) == 32


def test_a_wsum64_record_of_an_earlier_checkpoint_still_verifies(tmp_path):
    w = sample(4096).reshape(8, 128)
    write_record(tmp_path, "wsum64-v1", {"params/w": {"[0:8, 0:128]": python_wsum64(w.tobytes())}})
    recorded = read_recorded(str(tmp_path))
    assert verify({"params": {"w": w}}, recorded) == 1
    flipped = changed(w, lambda data: data.__setitem__(7, data[7] ^ 4))
    with pytest.raises(ChecksumMismatchError, match=r"\(wsum64-v1 [0-9a-f]{64} saved"):
        verify({"params": {"w": flipped.view(np.float32).reshape(w.shape)}}, recorded)
