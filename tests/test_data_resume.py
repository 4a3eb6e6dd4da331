"""dew.data readers with the trainer: a reader's position goes into the checkpoint (a
run stopped and resumed reads the same next batches as one that never stopped), and
the padded last validation batch leaves evaluation totals exact."""

import dataclasses
import io

import jax
import numpy as np
import optax
import pytest

from dew import models
from dew.data import Dataset, HFImages, Mixture, ParquetStream, TokenWindows
from dew.objectives.language.lm import LMObjective
from dew.train import Checkpoints, Trainer

SEQ_LEN = 16


class Recording:
    """A train iterator that keeps a copy of every batch it hands out; its position
    (get_state/set_state) is the wrapped Grain iterator's."""

    def __init__(self, iterator, seen):
        self._iterator, self._seen = iterator, seen

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._iterator)
        self._seen.append({k: np.array(v) for k, v in batch.items()})
        return batch

    def get_state(self):
        return self._iterator.get_state()

    def set_state(self, state):
        self._iterator.set_state(state)


def recorded(data: Dataset, seen: list) -> Dataset:
    return dataclasses.replace(data, train=lambda p: Recording(data.train(p), seen))


def fit(data, directory, steps):
    model = models.build(
        "causal_transformer",
        vocab_size=264,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=SEQ_LEN,
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=SEQ_LEN),
        optax.sgd(0.1),
        key=jax.random.key(0),
        checkpoints=Checkpoints(directory, use_async=False),
    )
    return trainer.fit(data, steps=steps, log_every=0, checkpoint_every=2)


def check_resume(data, tmp_path):
    straight: list = []
    fit(recorded(data, straight), tmp_path / "straight", steps=5)
    first: list = []
    fit(recorded(data, first), tmp_path / "stopped", steps=3)  # checkpoints at 2 and 3
    resumed: list = []
    fit(recorded(data, resumed), tmp_path / "stopped", steps=5)
    assert len(straight) == 5 and len(first) == 3 and len(resumed) == 2
    for got, expected in zip(first + resumed, straight):
        assert got.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
    # Guard against a constant stream making the check vacuous.
    assert not np.array_equal(straight[3]["text"], straight[4]["text"])


@pytest.mark.slow
def test_token_windows_resume_at_the_same_batch(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: dew reads its data on grain.\n" for i in range(60)))
    data = TokenWindows(corpus, seq_len=SEQ_LEN, cache_dir=tmp_path / "cache").load(batch=8)
    check_resume(data, tmp_path)


@pytest.mark.slow
def test_mixture_resumes_at_the_same_batch_across_a_weight_change(tmp_path):
    """Two corpora mixed 3:1, then 1:3 from step 3 (after the checkpoint at step 2): the
    resumed run reads what the straight run read, and the checkpoint records the
    sources' positions and the schedule."""
    sources = {}
    for name in ("web", "code"):
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text("".join(f"{name} line {i}: mixed on grain.\n" for i in range(40)))
        sources[name] = TokenWindows(corpus, seq_len=SEQ_LEN, cache_dir=tmp_path / "cache")
    mixture = Mixture(
        sources, {"web": 3, "code": 1}, schedule=[(3, {"web": 1, "code": 3})], read_threads=1
    )
    check_resume(mixture.load(batch=8), tmp_path)
    saved = [
        path.read_bytes()
        for path in (tmp_path / "stopped").rglob("*")
        if path.is_file() and b'"schedule"' in path.read_bytes()
    ]
    assert saved and all(b'"web"' in data and b'"position"' in data for data in saved)


@pytest.mark.slow
def test_hf_images_resume_at_the_same_batch(tmp_path):
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for _ in range(24):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(out, "PNG")
        images.append({"bytes": out.getvalue(), "path": None})
    table = datasets.Dataset.from_dict(
        {"image": images, "text": [f"caption number {i}" for i in range(24)]},
        features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")}),
    )
    # The LM objective trains on the captions; the images ride along in the same batches.
    data = HFImages(table, image_size=4, text_len=SEQ_LEN + 1).load(batch=8)
    check_resume(data, tmp_path)


def test_padded_validation_gives_the_exact_loss_of_the_real_windows(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"row {i} of the held-out text.\n" for i in range(40)))
    reader = TokenWindows(corpus, seq_len=SEQ_LEN, val_fraction=0.2, cache_dir=tmp_path / "c")
    data = reader.load(batch=8)
    ids = np.asarray(reader.tokens(), np.int64)
    windows = (len(ids) - 1) // SEQ_LEN
    first = data.records  # validation windows follow the training ones
    real = np.stack([ids[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(first, windows)])
    assert len(real) % 8, "the test needs a partial last validation batch"

    model = models.build(
        "causal_transformer",
        vocab_size=264,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=SEQ_LEN,
    )
    trainer = Trainer(
        LMObjective(model=model, seq_len=SEQ_LEN), optax.sgd(0.1), key=jax.random.key(1)
    )
    state = trainer.init_state()
    results = trainer.evaluate(state, data)

    # Reference: the mean next-token negative log-likelihood over the real windows only,
    # in numpy from the model's logits (float64 log-softmax).
    params = jax.device_get(state.params)
    logits = np.asarray(model.apply({"params": params}, real[:, :-1]), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, real[:, 1:, None], axis=-1)[..., 0]
    assert results["tokens"] == real.shape[0] * SEQ_LEN
    np.testing.assert_allclose(results["loss"], nll.mean(), rtol=1e-5)


@pytest.mark.slow
def test_parquet_stream_resumes_at_the_same_batch(tmp_path):
    """A datasets repository's parquet shards streamed: the checkpoint holds the
    (epoch, row group, row, id) the next window starts at."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    (tmp_path / "hub" / "data").mkdir(parents=True)
    for shard in range(2):
        rows = [f"shard {shard} row {i}: streamed." for i in range(24)]
        path = tmp_path / "hub" / "data" / f"train-{shard:05d}-of-00002.parquet"
        pq.write_table(pa.table({"text": rows}), path, row_group_size=6)
    check_resume(ParquetStream(tmp_path / "hub", seq_len=SEQ_LEN).load(batch=8), tmp_path)
