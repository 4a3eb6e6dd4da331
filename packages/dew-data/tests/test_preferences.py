"""PreferencePairs and Prompts: packing, padding and masks against hand-worked values."""

import numpy as np
import pytest

from dew.data import Partition, PreferencePairs, Prompts
from dew.data.preferences import pack

PAD, END = 257, 256


def ids(text):
    return list(text.encode())


def test_pack_hand_worked():
    out, prompt_mask, completion_mask = pack(
        [1, 2, 3], [7, 8], prompt_len=2, completion_len=3, pad_id=0
    )
    # The prompt keeps its last 2 ids, the completion follows at once, then padding.
    assert out.tolist() == [2, 3, 7, 8, 0]
    assert prompt_mask.tolist() == [True, True, False, False, False]
    assert completion_mask.tolist() == [False, False, True, True, False]
    out, _, completion_mask = pack([1], [5, 6, 7, 8], prompt_len=2, completion_len=2, pad_id=0)
    assert out.tolist() == [1, 5, 6, 0] and completion_mask.tolist() == [False, True, True, False]


def test_preference_pairs_from_jsonl(tmp_path, write_jsonl):
    rows = [
        {"prompt": "Q1?", "chosen": "yes", "rejected": "no", "extra": 1},
        {"prompt": "Q2 long prompt", "chosen": "fine answer", "rejected": "b"},
    ]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    data = PreferencePairs(
        tmp_path / "pairs.jsonl", prompt_len=4, completion_len=5, val_fraction=0.5
    ).load(batch=1)
    train = next(data.train(Partition()))
    assert set(train) == {"chosen", "rejected", "chosen_mask", "rejected_mask", "prompt_mask"}
    assert train["chosen"].tolist() == [ids("Q1?") + ids("yes") + [END] + [PAD] * 2]
    assert train["rejected"].tolist() == [ids("Q1?") + ids("no") + [END] + [PAD] * 3]
    assert train["prompt_mask"].tolist() == [[True] * 3 + [False] * 6]
    assert train["chosen_mask"].tolist() == [[False] * 3 + [True] * 4 + [False] * 2]
    assert train["rejected_mask"].tolist() == [[False] * 3 + [True] * 3 + [False] * 3]
    val = next(iter(data.val(Partition())))
    # "Q2 long prompt" keeps its last 4 bytes; "fine answer" its first 5 (no end id left).
    assert val["chosen"].tolist() == [ids("ompt") + ids("fine ")]
    assert val["rejected"].tolist() == [ids("ompt") + ids("b") + [END] + [PAD] * 3]
    assert val["example_mask"].tolist() == [True]


def test_preference_pairs_from_datasets_with_other_fields():
    import datasets

    dataset = datasets.Dataset.from_dict({"q": ["hi"], "good": ["a"], "bad": ["bc"]})
    data = PreferencePairs(
        dataset,
        prompt_len=2,
        completion_len=3,
        prompt_field="q",
        chosen_field="good",
        rejected_field="bad",
        end_id=9,
        pad_id=0,
    ).load(batch=1)
    batch = next(data.train(Partition()))
    assert batch["chosen"].tolist() == [ids("hi") + ids("a") + [9, 0]]
    assert batch["rejected"].tolist() == [ids("hi") + ids("bc") + [9]]
    with pytest.raises(KeyError, match=r"no column 'prompt'.*\['q', 'good', 'bad'\]"):
        PreferencePairs(dataset).load(batch=1)


def test_unknown_field_lists_the_fields(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(KeyError, match=r"line 1: no field 'prompt'.*'chosen', 'question'"):
        PreferencePairs(tmp_path / "p.jsonl").load(batch=1)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        Prompts(tmp_path / "absent.jsonl").load(batch=1)


def test_prompts_are_left_padded_with_answers_right_padded(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"question": ["2+2=", "a much longer question"], "answer": ["4", "42"]}),
        tmp_path / "q.parquet",
    )
    data = Prompts(
        tmp_path / "q.parquet",
        prompt_len=6,
        prompt_field="question",
        answer_field="answer",
        answer_len=3,
        seed=0,
    ).load(batch=2)
    batch = next(data.train(Partition()))
    order = np.argsort(batch["prompt_mask"].sum(axis=1))  # the short prompt first
    prompt, mask = batch["prompt"][order], batch["prompt_mask"][order]
    assert prompt.tolist() == [[PAD] * 2 + ids("2+2="), ids("estion")]
    assert mask.tolist() == [[False] * 2 + [True] * 4, [True] * 6]
    assert batch["answer"][order].tolist() == [ids("4") + [PAD] * 2, ids("42") + [PAD]]
    assert batch["answer_mask"][order].tolist() == [[True, False, False], [True, True, False]]


def left_padded(text, length):
    """numpy reference: the last ``length`` byte ids of ``text``, left-padded with PAD."""
    tail = np.frombuffer(text.encode(), np.uint8)[-length:].astype(np.int32)
    return np.concatenate([np.full(length - len(tail), PAD, np.int32), tail])


def val_rows(data):
    batches = list(data.val(Partition()))
    prompts = np.concatenate([b["prompt"] for b in batches])
    return prompts[np.concatenate([b["example_mask"] for b in batches])]


def test_prompts_validation_from_the_tail_the_head_or_a_separate_source(tmp_path, write_jsonl):
    questions = [f"question {i}" for i in range(10)]
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": q} for q in questions])
    expected = np.stack([left_padded(q, 8) for q in questions])
    for val_from, held_out in (("tail", expected[-3:]), ("head", expected[:3])):
        data = Prompts(
            tmp_path / "q.jsonl", prompt_len=8, val_fraction=0.3, val_from=val_from
        ).load(batch=7)
        np.testing.assert_array_equal(val_rows(data), held_out)
        train = next(data.train(Partition()))["prompt"]  # one epoch: the other 7 rows
        rest = expected[3:] if val_from == "head" else expected[:-3]
        assert sorted(map(tuple, train.tolist())) == sorted(map(tuple, rest.tolist()))
    write_jsonl(tmp_path / "held.jsonl", [{"prompt": "held out"}, {"prompt": "also held"}])
    data = Prompts(tmp_path / "q.jsonl", prompt_len=8, val_source=tmp_path / "held.jsonl").load(
        batch=10
    )
    assert data.records == 10  # every row of source trains
    np.testing.assert_array_equal(
        val_rows(data), np.stack([left_padded("held out", 8), left_padded("also held", 8)])
    )
    with pytest.raises(ValueError, match=r"val_from must be one of \('tail', 'head'\)"):
        Prompts(tmp_path / "q.jsonl", val_from="random")
