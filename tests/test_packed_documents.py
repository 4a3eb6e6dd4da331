"""TokenWindows(documents="pack") through a tiny CausalTransformer (TINY_LM: RoPE,
grouped-query attention): a packed window's logits equal each document's logits run
alone, so attention and positions restart at every document; and LMObjective's loss
on packed windows is the mean NLL over the documents' own targets (numpy float64),
padding and the targets across documents left out. Tolerance 1e-5: float32 logits."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import Partition, TokenWindows
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives import Step
from dew.objectives.language.lm import LMObjective

SEQ = 31
CONFIG = {**TINY_LM, "vocab_size": 264, "max_seq_len": SEQ}
KEYS = dict(segment_ids_key="segment_ids", positions_key="positions")
DOCS = ["hello world", "a", "packing whole documents", "dew", "rope restarts", "ok!", "xy"]


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed")
    with open(folder / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    reader = TokenWindows(
        folder / "docs.jsonl",
        seq_len=SEQ,
        documents="pack",
        val_fraction=0,
        cache_dir=folder / "cache",
        read_threads=0,
    )
    every = reader.load(batch=1).records
    return next(reader.load(batch=every).train(Partition()))  # every window, once


def alone(docs):
    """Each document's ids (with its end id), right-padded to SEQ, and its length."""
    rows = np.zeros((len(docs), SEQ), np.int32)
    lengths = []
    for row, doc in zip(rows, docs, strict=True):
        ids = [*doc.encode(), 256][:SEQ]
        row[: len(ids)] = ids
        lengths.append(len(ids))
    return rows, lengths


def documents_of(batch):
    """``(row, columns)`` of each document of every window, and its text."""
    found = []
    for r, segments in enumerate(batch["segment_ids"]):
        for segment in range(1, segments.max() + 1):
            columns = np.flatnonzero(segments == segment)
            text = bytes(batch["text"][r, columns[:-1]].tolist()).decode()
            found.append((r, columns, text))
    return found


def test_packed_logits_equal_each_document_alone(windows):
    found = documents_of(windows)
    assert sorted(text for *_, text in found) == sorted(DOCS)
    assert max(windows["segment_ids"].max(1)) > 2  # windows hold several documents
    model = CausalTransformer(**CONFIG)
    variables = nn.unbox(model.init(jax.random.key(0), windows["text"][:1, :SEQ]))
    apply = jax.jit(model.apply)
    packed = apply(
        variables,
        windows["text"][:, :SEQ],
        segment_ids=windows["segment_ids"][:, :SEQ],
        positions=windows["positions"][:, :SEQ],
    )
    rows, lengths = alone([text for *_, text in found])
    single = apply(variables, rows)
    for (r, columns, _), one, length in zip(found, single, lengths, strict=True):
        inside = columns[columns < SEQ]  # the last id of a window is only a target
        np.testing.assert_allclose(packed[r, inside], one[: len(inside)], atol=1e-5, rtol=1e-5)
        assert len(inside) == min(length, SEQ - columns[0])
    # Without segments and positions a later document attends to the earlier ones.
    plain = apply(variables, windows["text"][:, :SEQ])
    r, columns, _ = next(item for item in found if item[1][0] > 0)
    assert not np.allclose(plain[r, columns[columns < SEQ]], packed[r, columns[columns < SEQ]])


def test_loss_counts_each_documents_own_targets(windows):
    model = CausalTransformer(**CONFIG)
    objective = LMObjective(model, seq_len=SEQ, **KEYS)
    variables = nn.unbox(jax.jit(objective.init)(jax.random.key(0)))
    step = Step(index=jnp.int32(0), key=jax.random.key(0))
    loss, _ = jax.jit(objective.loss)(variables, windows, step)
    found = documents_of(windows)
    rows, lengths = alone([text for *_, text in found])
    policy = {"params": variables["params"]["policy"]}
    logits = np.asarray(jax.jit(model.apply)(policy, rows), np.float64)
    total, count = 0.0, 0
    for z, ids, length in zip(logits, rows, lengths, strict=True):
        z = z[: length - 1]  # predicts ids[1:length]
        nll = np.logaddexp.reduce(z, -1) - np.take_along_axis(z, ids[1:length, None], -1)[:, 0]
        total, count = total + nll.sum(), count + length - 1
    assert float(loss.weight) == count == sum(len(d.encode()) for d in DOCS)
    assert float(loss.value) == pytest.approx(total / count, rel=1e-5)
