"""TokenWindows: sources, the token cache, windows against a numpy reference, errors."""

import json
import os

import numpy as np
import pytest

from dew.data import ByteTokenizer, HFTokenizer, Partition, TokenWindows, _corpus

DOCS = ["the first document", "a second one, longer than the first", "3rd"]


def reference_ids(docs, end_id=256):
    ids = []
    for doc in docs:
        ids += list(doc.encode("utf-8")) + [end_id]
    return np.asarray(ids, np.int64)


def all_windows(data):
    """Every training window of the first epoch (batches until each window was seen)."""
    iterator = data.train(Partition())
    rows = [next(iterator)["text"] for _ in range(-(-data.records // (data.batch)))]
    return np.concatenate(rows)[: data.records]


def rows_of(docs, field="text"):
    return [{field: doc, "id": 1} for doc in docs]


def test_windows_are_the_tokenized_stream_cut_every_seq_len(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "docs.jsonl", rows_of(DOCS))
    reader = TokenWindows(
        tmp_path / "docs.jsonl", seq_len=8, cache_dir=tmp_path / "c", val_fraction=0.2, seed=1
    )
    ids = reference_ids(DOCS)
    np.testing.assert_array_equal(reader.tokens(), ids)
    data = reader.load(batch=2)
    windows = (len(ids) - 1) // 8
    held_out = round(windows * 0.2)
    assert data.records == windows - held_out
    expected = [ids[i * 8 : i * 8 + 9] for i in range(windows)]
    seen = all_windows(data)
    assert seen.dtype == np.int32 and seen.shape == (data.records, 9)
    # One epoch shuffles the training windows: each exactly once, not in order.
    assert sorted(map(tuple, seen)) == sorted(map(tuple, expected[: windows - held_out]))
    assert [tuple(w) for w in seen] != [tuple(w) for w in expected[: windows - held_out]]
    # Validation is the last windows of the corpus, in order, padded to the batch.
    val = list(data.val(Partition()))
    rows = np.concatenate([b["text"] for b in val])[
        np.concatenate([b["example_mask"] for b in val])
    ]
    np.testing.assert_array_equal(rows, np.stack(expected[windows - held_out :]))


def test_txt_parquet_and_datasets_sources_agree(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc)
    pq.write_table(pa.table({"body": DOCS, "n": [1, 2, 3]}), tmp_path / "docs.parquet")
    expected = reference_ids(DOCS)
    from_dir = TokenWindows(tmp_path, seq_len=4, field="body", cache_dir=tmp_path / "c")
    # The directory holds the three .txt files and the parquet file (sorted by name).
    np.testing.assert_array_equal(from_dir.tokens(), np.concatenate([expected, expected]))
    parquet = TokenWindows(
        tmp_path / "docs.parquet", seq_len=4, field="body", cache_dir=tmp_path / "c"
    )
    np.testing.assert_array_equal(parquet.tokens(), expected)
    hf = datasets.Dataset.from_dict({"body": DOCS})
    from_hf = TokenWindows(hf, seq_len=4, field="body", cache_dir=tmp_path / "c")
    np.testing.assert_array_equal(from_hf.tokens(), expected)


def test_corpus_is_tokenized_once_and_again_when_an_input_changes(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("hello cache")
    reads = []
    real_texts = _corpus.texts
    monkeypatch.setattr(
        "dew.data.token_windows.texts", lambda p, f: reads.append(p) or real_texts(p, f)
    )
    cache = tmp_path / "cache"
    TokenWindows(path, seq_len=4, cache_dir=cache).tokens()
    TokenWindows(path, seq_len=2, seed=7, cache_dir=cache).tokens()  # same inputs: cached
    assert len(reads) == 1
    assert len(os.listdir(cache)) == 1  # one corpus directory
    TokenWindows(path, seq_len=4, end_id=3, cache_dir=cache).tokens()  # another end id
    assert len(reads) == 2
    path.write_text("hello cache, changed")
    os.utime(path, ns=(1, 1))
    ids = TokenWindows(path, seq_len=4, cache_dir=cache).tokens()
    assert len(reads) == 3
    np.testing.assert_array_equal(ids, reference_ids(["hello cache, changed"]))


def make_hf_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, "the": 3, "first": 4, "document": 5, "a": 6}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>"}, f)
    return HFTokenizer(directory)


def test_hf_tokenizer_ids_and_end_id(tmp_path, write_jsonl):
    tokenizer = make_hf_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "d.jsonl", rows_of(["the first document", "a document"]))
    reader = TokenWindows(
        tmp_path / "d.jsonl", seq_len=2, tokenizer=tokenizer, cache_dir=tmp_path / "c"
    )
    # Hand-worked: the=3 first=4 document=5 <eos>=1 a=6 document=5 <eos>=1
    assert reader.tokens().tolist() == [3, 4, 5, 1, 6, 5, 1]
    assert reader.tokens().dtype == np.uint16
    plain = HFTokenizer(tmp_path / "tok", add_special_tokens=False)
    assert plain.fingerprint() != tokenizer.fingerprint()  # other ids, another cache
    data = reader.load(batch=1)
    assert data.records == 2  # windows [3 4 5] [5 1 6]; [6 5 1] held out
    assert next(iter(data.val(Partition())))["text"].tolist() == [[6, 5, 1]]


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_file_is_named(tmp_path, name):
    make_hf_tokenizer(tmp_path / "tok")
    file = tmp_path / "tok" / name
    text = file.read_text()
    file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError) as error:
        HFTokenizer(tmp_path / "tok")
    message = str(error.value)
    assert message.startswith(str(file)) and "cut off" in message
    assert "download or save the tokenizer again" in message.lower()


def test_missing_path_and_empty_corpus_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        TokenWindows(tmp_path / "nowhere.txt", seq_len=4, cache_dir=tmp_path).load(batch=2)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        TokenWindows(tmp_path / "empty.txt", seq_len=4, cache_dir=tmp_path).load(batch=2)
    (tmp_path / "notes.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"notes\.csv.*\.txt, \.jsonl, \.parquet"):
        TokenWindows(tmp_path / "notes.csv", seq_len=4, cache_dir=tmp_path).load(batch=2)


def test_short_corpus_gives_both_counts(tmp_path):
    (tmp_path / "short.txt").write_text("abc")  # 3 bytes + end id = 4 tokens
    with pytest.raises(ValueError, match=r"has 4 tokens .*seq_len \+ 1 = 9"):
        TokenWindows(tmp_path / "short.txt", seq_len=8, cache_dir=tmp_path).load(batch=2)


def test_unknown_field_lists_the_fields(tmp_path, write_jsonl):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "d.jsonl", rows_of(DOCS, field="content"))
    with pytest.raises(KeyError, match=r"no field 'text'.*\['content', 'id'\]"):
        TokenWindows(tmp_path / "d.jsonl", seq_len=4, cache_dir=tmp_path).load(batch=2)
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "d.parquet")
    with pytest.raises(KeyError, match=r"no column 'text'.*\['body'\]"):
        TokenWindows(tmp_path / "d.parquet", seq_len=4, cache_dir=tmp_path).load(batch=2)


def test_tokenizer_without_end_id_needs_one(tmp_path):
    tokenizer = ByteTokenizer()
    tokenizer.end_id = None  # an instance attribute shadows the class's
    with pytest.raises(ValueError, match="pass end_id="):
        TokenWindows(tmp_path, seq_len=4, tokenizer=tokenizer)


def windows_of(ids, seq_len):
    """numpy reference: every window of seq_len + 1 ids, stride seq_len."""
    count = (len(ids) - 1) // seq_len
    return np.stack([ids[w * seq_len : w * seq_len + seq_len + 1] for w in range(count)])


def real_val_rows(data):
    batches = list(data.val(Partition()))
    rows = np.concatenate([b["text"] for b in batches])
    return rows[np.concatenate([b["example_mask"] for b in batches])]


def test_validation_windows_from_the_tail_the_head_or_separate_files(tmp_path):
    text = "".join(f"line {i} of the corpus. " for i in range(12))
    (tmp_path / "train.txt").write_text(text)
    windows = windows_of(reference_ids([text]), 8)
    held_out = round(len(windows) * 0.2)
    cache = tmp_path / "c"
    for val_from, val, train in (
        ("tail", windows[-held_out:], windows[:-held_out]),
        ("head", windows[:held_out], windows[held_out:]),
    ):
        reader = TokenWindows(
            tmp_path / "train.txt", seq_len=8, val_fraction=0.2, val_from=val_from, cache_dir=cache
        )
        data = reader.load(batch=4)
        np.testing.assert_array_equal(real_val_rows(data), val)
        assert sorted(map(tuple, all_windows(data))) == sorted(map(tuple, train))
    other = "a separate validation text, read whole."
    (tmp_path / "val.txt").write_text(other)
    data = TokenWindows(
        tmp_path / "train.txt", seq_len=8, val_paths=tmp_path / "val.txt", cache_dir=cache
    ).load(batch=4)
    assert data.records == len(windows)  # val_fraction is not used: every window trains
    np.testing.assert_array_equal(real_val_rows(data), windows_of(reference_ids([other]), 8))
    with pytest.raises(ValueError, match="val_from must be one of"):
        TokenWindows(tmp_path / "train.txt", seq_len=8, val_from="middle")


def test_a_batch_larger_than_the_training_windows_gives_both_numbers(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 40)  # 41 ids: 5 windows of 9, 1 held out
    reader = TokenWindows(tmp_path / "small.txt", seq_len=8, val_fraction=0.2, cache_dir=tmp_path)
    assert reader.load(batch=4).records == 4
    with pytest.raises(ValueError, match=r"batch of 5 examples is larger than the 4 training"):
        reader.load(batch=5)


def test_mask_ids_of_the_tokenizers(tmp_path):
    """The byte tokenizer's mask id is an unused id below its vocab_size; a Hugging Face
    tokenizer without one gains ``mask_token`` as the next id, encodes it to that id,
    saves it, and fingerprints differently; without ``mask_token`` it has none."""
    assert ByteTokenizer.mask_id == 258 < ByteTokenizer.vocab_size
    assert 258 not in ByteTokenizer().encode("any text \u00ff\u20ac")
    plain = make_hf_tokenizer(tmp_path / "tok")
    assert plain.mask_id is None and plain.vocab_size == 7
    masked = HFTokenizer(tmp_path / "tok", mask_token="[MASK]")
    assert (masked.mask_id, masked.vocab_size) == (7, 8)
    assert masked.encode("the [MASK] a") == [3, 7, 6]
    assert masked.fingerprint() != plain.fingerprint()
    masked.save(tmp_path / "saved")
    again = HFTokenizer(tmp_path / "saved")
    assert (again.mask_id, again.vocab_size) == (7, 8)
