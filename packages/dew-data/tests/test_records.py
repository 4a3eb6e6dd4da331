"""from_records: partitions, epochs, the padded validation batch, skipped records, positions."""

import logging

import grain
import numpy as np
import pytest

from dew.data import Partition, RecordError, from_records


class Numbers:
    """Record i is {"x": [i, 10 i]}; the records in ``bad`` cannot be read."""

    def __init__(self, count, bad=()):
        self.count, self.bad = count, set(bad)

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        if index in self.bad:
            raise RecordError(f"number {index}", "it is bad")
        return {"x": np.asarray([index, 10 * index], np.int64)}


def take(iterator, count):
    return [next(iterator)["x"][:, 0].tolist() for _ in range(count)]


@pytest.mark.parametrize("threads", [0, 2])
def test_partitions_put_side_by_side_are_the_one_process_batch(threads):
    data = from_records(Numbers(20), batch=8, seed=3, read_threads=threads)
    whole = take(data.train(Partition()), 6)
    for count in (2, 4, 8):  # 8: one row per process
        shares = [take(data.train(Partition(i, count)), 6) for i in range(count)]
        for step in range(6):
            rows = [r for share in shares for r in share[step]]
            assert rows == whole[step]
            assert all(len(share[step]) == 8 // count for share in shares)


def test_each_epoch_is_a_new_permutation_of_all_records():
    data = from_records(Numbers(12), batch=4, seed=0)
    stream = [r for batch in take(data.train(Partition()), 9) for r in batch]  # 3 epochs
    epochs = [stream[i * 12 : (i + 1) * 12] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(12))
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = from_records(Numbers(12), batch=4, seed=1)
    assert take(other_seed.train(Partition()), 3) != [epochs[0][i : i + 4] for i in (0, 4, 8)]


def test_last_validation_batch_is_padded_and_masked_so_sums_are_exact():
    data = from_records(Numbers(8), Numbers(10), batch=4)
    batches = list(data.val(Partition()))
    assert len(batches) == 3  # ceil(10 / 4)
    masks = np.concatenate([b["example_mask"] for b in batches])
    assert masks.tolist() == [True] * 10 + [False] * 2
    # The weighted sum over every batch equals the plain sum over the 10 records.
    total = sum(float((b["x"][:, 1] * b["example_mask"]).sum()) for b in batches)
    assert total == 10 * sum(range(10))
    # Padding rows are zeros shaped like a record.
    assert batches[-1]["x"][2:].tolist() == [[0, 0], [0, 0]]
    # Two processes: the same global batches, split in contiguous halves.
    halves = [list(data.val(Partition(i, 2))) for i in range(2)]
    for step, batch in enumerate(batches):
        joined = np.concatenate([halves[0][step]["x"], halves[1][step]["x"]])
        np.testing.assert_array_equal(joined, batch["x"])
        assert halves[0][step]["x"].shape[0] == 2


def test_iterator_position_restores_exactly():
    data = from_records(Numbers(10), batch=4, seed=5)
    iterator = data.train(Partition(1, 2))
    assert isinstance(iterator, grain.DatasetIterator)
    take(iterator, 7)  # crosses epoch boundaries
    state = iterator.get_state()
    expected = take(iterator, 5)
    fresh = data.train(Partition(1, 2))
    fresh.set_state(state)
    assert take(fresh, 5) == expected


def test_unreadable_record_is_an_error_naming_it():
    data = from_records(Numbers(6, bad={2}), batch=6, read_threads=0)
    with pytest.raises(RecordError, match=r"number 2.*skip_errors=True"):
        next(data.train(Partition()))


def test_skipped_records_are_replaced_in_training_and_masked_in_validation(caplog):
    data = from_records(
        Numbers(6, bad={2}),
        Numbers(3, bad={1}),
        batch=6,
        skip_errors=True,
        read_threads=0,
        name="numbers",
    )
    with caplog.at_level(logging.WARNING, logger="dew.data"):
        epoch = take(data.train(Partition()), 1)[0]
        val = next(iter(data.val(Partition())))
    # Record 2 is replaced by the next readable record, 3.
    assert sorted(epoch) == [0, 1, 3, 3, 4, 5]
    assert val["example_mask"].tolist() == [True, False, True, False, False, False]
    assert val["x"][:, 0].tolist() == [0, 0, 2, 0, 0, 0]
    messages = [r.getMessage() for r in caplog.records]
    assert any("numbers: skipped unreadable record number 2" in m for m in messages)
    assert any("number 1" in m and "2 skipped so far" in m for m in messages)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="no records"):
        from_records(Numbers(0), batch=2)
    with pytest.raises(ValueError, match="does not divide over 3 processes"):
        from_records(Numbers(4), batch=4).train(Partition(0, 3))
    with pytest.raises(ValueError, match="seed"):
        from_records(Numbers(4), batch=4, seed=-1)
    with pytest.raises(ValueError, match=r"batch of 5 examples is larger than the 4 training"):
        from_records(Numbers(4), Numbers(9), batch=5)  # a val source may be smaller or larger
