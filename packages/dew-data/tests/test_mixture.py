"""Mixture: Grain's weighted interleave, proportions, per-source positions and epochs,
exact resume across a schedule, exhaustion, partitions, and bad input."""

import itertools

import grain
import numpy as np
import pytest

from dew.data import Field, Mixture, Partition, TokenWindows
from dew.data.mixture import interleave_counts, proportions


class Table:
    """A reader of ``size`` records ``{"source": tag, "index": i}``; a held-out tail."""

    def __init__(self, tag, size, *, val=0, seed=0, fields=None):
        self.tag, self.size, self.val, self.seed = tag, size, val, seed
        self.fields = fields or {"source": Field((), np.int32), "index": Field((), np.int32)}

    def splits(self):
        return _Records(self.tag, range(self.size), self.fields), (
            _Records(self.tag, range(self.size, self.size + self.val), self.fields)
            if self.val
            else None
        )


class _Records:
    def __init__(self, tag, indices, spec):
        self.tag, self.indices, self.spec = tag, list(indices), spec

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        example = {"source": np.int32(self.tag), "index": np.int32(self.indices[i])}
        return {key: example.get(key, np.zeros(f.shape, f.dtype)) for key, f in self.spec.items()}


SOURCES = {"web": Table(0, 50, val=3), "code": Table(1, 20, val=2), "books": Table(2, 7)}
WEIGHTS = {"web": 0.7, "code": 0.2, "books": 0.1}


def batches(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_selection_is_grains_weighted_interleave():
    """The source of each position equals grain.MapDataset.mix's, and the counts of any
    prefix equal the closed form's."""
    parents = [
        grain.MapDataset.range(10**6).map(lambda i, s=s: (s, i)) for s in range(len(WEIGHTS))
    ]
    mixed = grain.MapDataset.mix(parents, weights=list(WEIGHTS.values()))
    expected = np.asarray([mixed[k] for k in range(1000)])
    parts = proportions(list(WEIGHTS.values()))
    counts = interleave_counts(np.arange(1001), parts)
    source = np.argmax(np.diff(counts, axis=0), axis=1)
    np.testing.assert_array_equal(source, expected[:, 0])
    within = counts[np.arange(1000), source]
    np.testing.assert_array_equal(within, expected[:, 1])


def test_proportions_match_the_weights_and_positions_are_checkpointed():
    data = Mixture(SOURCES, WEIGHTS, read_threads=0, prefetch=0).load(batch=8)
    iterator = data.train(Partition())
    seen = np.concatenate([b["source"] for b in batches(iterator, 250)])
    counts = np.bincount(seen, minlength=3)
    expected = np.asarray(list(WEIGHTS.values())) * len(seen)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.82, (counts, expected)  # chi-square, 2 degrees of freedom, p = 0.001
    state = iterator.get_state()
    assert state["step"] == 250
    for name, tag in (("web", 0), ("code", 1), ("books", 2)):
        source = state["sources"][name]
        assert source["position"] == counts[tag]
        assert source["epoch"] == counts[tag] // SOURCES[name].size
    assert state["weights"] == WEIGHTS


def test_each_epoch_of_a_repeated_source_is_a_new_permutation():
    data = Mixture(SOURCES, WEIGHTS, read_threads=0, prefetch=0).load(batch=8)
    rows = batches(data.train(Partition()), 40)
    source = np.concatenate([b["source"] for b in rows])
    index = np.concatenate([b["index"] for b in rows])
    books = index[source == 2]  # 32 examples of a 7-record source: 4 whole epochs
    epochs = [books[e * 7 : (e + 1) * 7] for e in range(4)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled


def test_resume_is_exact_across_a_schedule():
    """1,000 batches in one run equal 500, a saved position, then 500 more; the weights
    change at step 300 and the change is in the position."""
    schedule = [(300, {"web": 0.2, "code": 0.3, "books": 0.5})]
    mixture = Mixture(SOURCES, WEIGHTS, schedule=schedule, read_threads=1, prefetch=2)
    data = mixture.load(batch=4)
    straight = batches(data.train(Partition()), 1000)
    first = data.train(Partition())
    batches(first, 500)
    state = first.get_state()
    assert state["weights"] == schedule[0][1]
    assert state["schedule"] == [[0, WEIGHTS], [300, schedule[0][1]]]
    resumed = data.train(Partition())
    resumed.set_state(state)
    for got, expected in zip(batches(resumed, 500), straight[500:], strict=True):
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])
    late = np.concatenate([b["source"] for b in straight[300:]])
    np.testing.assert_allclose(np.bincount(late) / len(late), [0.2, 0.3, 0.5], atol=0.002)
    # A checkpoint whose earlier stage was read with other weights cannot resume.
    changed = Mixture(SOURCES, WEIGHTS, schedule=[(200, schedule[0][1])], read_threads=0)
    with pytest.raises(ValueError, match="Keep the stages before step 500"):
        changed.load(batch=4).train(Partition()).set_state(state)
    with pytest.raises(ValueError, match="is not a Mixture's"):
        data.train(Partition()).set_state({"next_index": 3})


def test_partitions_put_side_by_side_are_the_whole_batch():
    data = Mixture(SOURCES, WEIGHTS, read_threads=0, prefetch=0).load(batch=8)
    whole = batches(data.train(Partition()), 5)
    halves = [batches(data.train(Partition(p, 2)), 5) for p in range(2)]
    for step in range(5):
        for key in whole[step]:
            joined = np.concatenate([halves[0][step][key], halves[1][step][key]])
            np.testing.assert_array_equal(joined, whole[step][key])


def test_stop_ends_at_the_last_batch_every_source_fills():
    data = Mixture(SOURCES, WEIGHTS, exhausted="stop", read_threads=0, prefetch=0).load(batch=4)
    rows = list(data.train(Partition()))
    pairs = [(s, i) for b in rows for s, i in zip(b["source"], b["index"], strict=True)]
    assert len(set(pairs)) == len(pairs)  # no example twice
    # One more batch of Grain's interleave would need an eighth example of "books".
    parents = [grain.MapDataset.range(10**6).map(lambda i, s=s: s) for s in range(3)]
    mixed = grain.MapDataset.mix(parents, weights=list(WEIGHTS.values()))
    more = np.bincount([mixed[k] for k in range((len(rows) + 1) * 4)], minlength=3)
    assert np.any(more > [50, 20, 7])
    assert np.all(np.bincount([s for s, _ in pairs], minlength=3) <= [50, 20, 7])


def test_validation_is_one_pass_over_each_source():
    data = Mixture(SOURCES, WEIGHTS, read_threads=0, prefetch=0).load(batch=2)
    val = list(data.val(Partition()))
    mask = np.concatenate([b["example_mask"] for b in val])
    got = np.stack([np.concatenate([b[k] for b in val])[mask] for k in ("source", "index")], 1)
    assert got.tolist() == [[0, 50], [0, 51], [0, 52], [1, 20], [1, 21]]


def test_one_source_reads_what_the_reader_alone_reads(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a tiny corpus\n" for i in range(30)))
    reader = TokenWindows(corpus, seq_len=8, cache_dir=tmp_path / "c", seed=3, read_threads=0)
    alone = reader.load(batch=4)
    mixed = Mixture({"only": reader}, {"only": 1.0}, read_threads=0).load(batch=4)
    assert mixed.spec == alone.spec and mixed.records == alone.records
    for got, expected in zip(
        itertools.islice(mixed.train(Partition()), 30),
        itertools.islice(alone.train(Partition()), 30),
    ):
        np.testing.assert_array_equal(got["text"], expected["text"])
    for got, expected in zip(mixed.val(Partition()), alone.val(Partition()), strict=True):
        np.testing.assert_array_equal(got["text"], expected["text"])


@pytest.mark.parametrize(
    "weights, schedule, match",
    [
        ({"web": -1, "code": 1}, (), r"Mixture.weights\['web'\] is -1.0"),
        ({"web": 0, "code": 0}, (), "all zero"),
        ({"web": 1, "cod": 1}, (), r"names \['cod'\], which are not sources"),
        ({"web": 1}, [(10, {"code": 1}), (5, {"web": 1})], "strictly increasing"),
        ({"web": 1}, [(0, {"code": 1})], "strictly increasing"),
        ({"web": 1}, [(10, {"code": float("nan")})], "finite"),
    ],
)
def test_bad_weights_are_errors_when_built(weights, schedule, match):
    with pytest.raises(ValueError, match=match):
        Mixture({"web": SOURCES["web"], "code": SOURCES["code"]}, weights, schedule=schedule)


def test_sources_with_other_fields_or_shapes_are_named(tmp_path):
    other = Table(1, 20, fields={"source": Field((), np.int32), "label": Field((), np.int32)})
    with pytest.raises(ValueError, match="source 'web' has the field 'index' and source 'code'"):
        Mixture({"web": SOURCES["web"], "code": other}, {"web": 1}).load(batch=2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to cut into windows, " * 10)
    short = TokenWindows(corpus, seq_len=8, cache_dir=tmp_path / "c")
    long = TokenWindows(corpus, seq_len=16, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match=r"'text' is int32 \[17\] in source 'long'"):
        Mixture({"short": short, "long": long}, {"short": 1, "long": 1}).load(batch=2)
    with pytest.raises(ValueError, match="not even one global batch"):
        Mixture(SOURCES, WEIGHTS, exhausted="stop").load(batch=128)
    with pytest.raises(ValueError, match="exhausted must be one of"):
        Mixture(SOURCES, WEIGHTS, exhausted="cycle")
