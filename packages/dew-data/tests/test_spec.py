"""Dataset.spec: each reader states its batch shapes once, and its batches have them."""

import io
import itertools

import numpy as np
import pytest

from dew.data import (
    Dataset,
    Field,
    HFImages,
    Partition,
    PreferencePairs,
    Prompts,
    TokenWindows,
    Videos,
    from_records,
    spec_of_batch,
)


def png(array):
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def token_windows(tmp_path, write_jsonl):
    (tmp_path / "corpus.txt").write_text("the spec is stated once. " * 8)
    reader = TokenWindows(tmp_path / "corpus.txt", seq_len=12, val_fraction=0.2, cache_dir=tmp_path)
    return reader.load(batch=4), {"text": ((13,), "int32")}


def hf_images(tmp_path, write_jsonl):
    import datasets

    rng = np.random.default_rng(0)
    table = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": png(rng.integers(0, 256, (7, 9, 3), np.uint8))} for _ in range(5)],
            "label": [0, 1, 0, 1, 1],
            "caption": ["a", "bb", "ccc", "", "eeeee"],
        },
        features=datasets.Features(
            {
                "image": datasets.Image(),
                "label": datasets.Value("int64"),
                "caption": datasets.Value("string"),
            }
        ),
    )
    data = HFImages(table, image_size=5, text_len=3, val_fraction=0.4, read_threads=0)
    expected = {
        "image": ((5, 5, 3), "uint8"),
        "label": ((), "int32"),
        "text": ((3,), "int32"),
        "text_mask": ((3,), "bool"),
    }
    return data.load(batch=2), expected


def videos(tmp_path, write_jsonl):
    for name, frames in (("a", 9), ("b", 6)):
        np.save(tmp_path / f"{name}.npy", np.full((frames, 6, 10, 3), frames, np.uint8))
    data = Videos(tmp_path, frames=3, val_fraction=0.4).load(batch=2)
    return data, {"video": ((3, 6, 10, 3), "uint8")}


def preference_pairs(tmp_path, write_jsonl):
    rows = [{"prompt": f"q{i}", "chosen": "yes" * i, "rejected": "no"} for i in range(5)]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    data = PreferencePairs(
        tmp_path / "pairs.jsonl", prompt_len=3, completion_len=4, val_fraction=0.4
    ).load(batch=2)
    row = ((7,), "int32")
    mask = ((7,), "bool")
    expected = {"chosen": row, "rejected": row}
    expected |= {"chosen_mask": mask, "rejected_mask": mask, "prompt_mask": mask}
    return data, expected


def prompts(tmp_path, write_jsonl):
    rows = [{"prompt": f"prompt {i}", "answer": i} for i in range(5)]
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    data = Prompts(
        tmp_path / "prompts.jsonl",
        prompt_len=6,
        answer_field="answer",
        answer_len=2,
        val_fraction=0.4,
    ).load(batch=2)
    expected = {
        "prompt": ((6,), "int32"),
        "prompt_mask": ((6,), "bool"),
        "answer": ((2,), "int32"),
        "answer_mask": ((2,), "bool"),
    }
    return data, expected


class Pairs:
    """Record i: {"x": float32 [2, 3] filled with i, "y": int64 i}."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return {"x": np.full((2, 3), i, np.float32), "y": np.asarray(i)}


def records(tmp_path, write_jsonl):
    data = from_records(Pairs(6), Pairs(3), batch=4)  # the spec read from record 0
    return data, {"x": ((2, 3), "float32"), "y": ((), "int64")}


READERS = [token_windows, hf_images, videos, preference_pairs, prompts, records]


def seen(batch):
    """What a batch holds, by numpy: {key: (per-row shape, dtype name)}."""
    return {key: (value.shape[1:], value.dtype.name) for key, value in batch.items()}


@pytest.mark.parametrize("build", READERS, ids=lambda f: f.__name__)
def test_declared_spec_is_what_the_batches_hold(build, tmp_path, write_jsonl):
    data, expected = build(tmp_path, write_jsonl)
    declared = {key: (field.shape, field.dtype.name) for key, field in data.spec.items()}
    assert declared == expected  # stated from the reader's arguments
    for partition in (Partition(), Partition(1, 2)):
        rows = data.batch // partition.count
        train = data.train(partition)
        for batch in itertools.islice(train, 3):
            assert seen(batch) == expected
            assert {len(value) for value in batch.values()} == {rows}
        val = list(data.val(partition))
        assert val, "every reader above has a validation set"
        for batch in val:
            assert seen(batch) == expected | {"example_mask": ((), "bool")}
            assert {len(value) for value in batch.values()} == {rows}
    assert data.val_spec == {**data.spec, "example_mask": Field((), bool)}


def test_spec_of_names_the_keys_there_are():
    data = Dataset(
        train=lambda p: iter([]), val=None, records=8, batch=8, spec={"text": ((65,), "int32")}
    )
    assert data.spec == {"text": Field((65,), np.int32)}  # a (shape, dtype) pair becomes a Field
    assert data.spec_of("text").rows(8) == (8, 65)
    with pytest.raises(KeyError, match=r"no batch key 'image'.*its keys are \['text'\]"):
        data.spec_of("image")
    undeclared = Dataset(train=lambda p: iter([]), val=None, records=8, batch=8)
    assert undeclared.spec is None and undeclared.val_spec is None
    with pytest.raises(KeyError, match="declares no spec"):
        undeclared.spec_of("text")
    with pytest.raises(ValueError, match="example_mask"):
        Dataset(lambda p: iter([]), None, 8, 8, spec={"example_mask": ((), bool)})
    with pytest.raises(TypeError, match=r"spec\['x'\] must be a Field"):
        Dataset(lambda p: iter([]), None, 8, 8, spec={"x": "int32"})
    batch = {"b": np.zeros((4, 2), np.uint8), "a": np.zeros(4, bool)}
    assert spec_of_batch(batch) == {"a": Field((), bool), "b": Field((2,), np.uint8)}


class Ragged:
    """Record i: {"x": int32 [1 + i % 2]}: odd records are longer than even ones."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": np.zeros(1 + i % 2, np.int32)}


class WrongBatch(Ragged):
    def read_batch(self, indices):
        return {"x": np.zeros((len(indices), 1), np.int64)}  # not the dtype of a record


def test_records_that_break_the_spec_are_errors_naming_the_key():
    data = from_records(Ragged(), batch=4, read_threads=0)
    assert data.spec == {"x": Field((1,), np.int32)}  # from record 0
    with pytest.raises(ValueError, match=r"key 'x' has shapes \[1\], \[2\]"):
        next(data.train(Partition()))
    data = from_records(WrongBatch(), batch=2, read_threads=0)
    with pytest.raises(ValueError, match=r"key 'x' is int64 \[2, 1\] but the spec declares int32"):
        next(data.train(Partition()))
    data = from_records(WrongBatch(), batch=2, spec={"x": ((1,), "int64")}, read_threads=0)
    assert next(data.train(Partition()))["x"].shape == (2, 1)  # the given spec is used
