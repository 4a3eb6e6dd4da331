"""Offline distillation: the teacher's top-k written once (write_teacher_topk, safetensors
shards), read back by dew.data.TeacherTopK (a Grain reader that resumes exactly), and
DistillationObjective(stored_teacher=True) on it.

The loss on the k ids + tail against a numpy float64 transcription at several beta and
T; with k = the vocabulary it is the online loss (the teacher run in the step), values
and gradients, on packed SFT rows; a stored cache is never overwritten."""

import itertools
import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from dew.data import Partition, SFTExamples, TeacherTopK, TopKWriter
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_GPT2
from dew.objectives import Step
from dew.objectives.language.distillation import DistillationObjective
from dew.objectives.language.teacher_topk import teacher_topk, topk_divergence, write_teacher_topk

SEQ, V = 15, 264
STUDENT = CausalTransformer(**{**TINY_GPT2, "vocab_size": V, "max_seq_len": SEQ})
TEACHER = STUDENT.clone(emb_features=2 * STUDENT.emb_features, tie_embeddings=False)
STEP = Step(index=np.int32(0), key=jax.random.key(0))
ROWS = [("2+2=", "4"), ("say hi: ", "hi"), ("x", "yz"), ("why? ", "no"), ("a", "bc"), ("q", "r")]
KEYS = dict(loss_mask_key="loss_mask", segment_ids_key="segment_ids", positions_key="positions")


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_topk_divergence(zs, zt, k, beta, temperature):
    """The k + 1 categories of the teacher's top k, float64, from both full logits."""
    s, t = log_softmax(zs / temperature), log_softmax(zt / temperature)
    top = np.argsort(-zt, axis=-1, kind="stable")[..., :k]
    ps, pt = np.exp(s), np.exp(t)
    ps_k, pt_k = np.take_along_axis(ps, top, -1), np.take_along_axis(pt, top, -1)
    ps = np.concatenate([ps_k, 1 - ps_k.sum(-1, keepdims=True)], -1)
    pt = np.concatenate([pt_k, 1 - pt_k.sum(-1, keepdims=True)], -1)
    if beta == 0:
        return (pt * np.log(pt / ps)).sum(-1)
    if beta == 1:
        return (ps * np.log(ps / pt)).sum(-1)
    m = beta * pt + (1 - beta) * ps
    jsd = beta * (pt * np.log(pt / m)).sum(-1) + (1 - beta) * (ps * np.log(ps / m)).sum(-1)
    return jsd / (beta * (1 - beta))


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_topk_divergence_matches_numpy(temperature):
    rng = np.random.default_rng(0)
    zs = rng.normal(size=(3, 4, 24)).astype(np.float32) * 2
    zt = rng.normal(size=(3, 4, 24)).astype(np.float32) * 3

    @jax.jit
    def run(zs, zt):
        stored = teacher_topk(zt, k=5, temperature=temperature)
        return [topk_divergence(zs, *stored, beta=b, temperature=temperature) for b in BETAS]

    for beta, got in zip(BETAS, run(zs, zt), strict=True):
        want = np_topk_divergence(zs, zt, 5, beta, temperature)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=f"beta {beta}")


BETAS = [0.0, 0.2, 0.5, 1.0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Packed SFT rows, the teacher's top-k of them written with k = V and k = 8 in
    shards of 2 rows, and the teacher's weights."""
    root = tmp_path_factory.mktemp("topk")
    (root / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS)
    )
    ids = np.zeros((1, SEQ), np.int32)
    teacher = nn.unbox(jax.jit(TEACHER.init)(jax.random.key(2), ids))["params"]
    teacher = jax.tree.map(lambda x: 3.0 * x, teacher)
    reader = SFTExamples(root / "rows.jsonl", seq_len=SEQ, packing=True, read_threads=0)
    data = reader.load(batch=1)
    windows = data.records
    for k in (V, 8):
        write_teacher_topk(
            root / f"k{k}",
            itertools.islice(data.train(Partition()), windows),  # epoch 0: every window once
            teacher=TEACHER,
            teacher_params=teacher,
            k=k,
            temperature=2.0,
            rows_per_shard=2,
            segment_ids_key="segment_ids",
            positions_key="positions",
        )
    return root, teacher, windows


def stored_batch(path, windows):
    data = TeacherTopK(path, read_threads=0).load(batch=windows)
    return next(data.train(Partition()))


def test_k_equal_to_the_vocabulary_is_the_online_loss_values_and_gradients(cache):
    root, teacher, windows = cache
    assert windows >= 3 and len(list((root / f"k{V}").glob("*.safetensors"))) >= 2
    batch = stored_batch(root / f"k{V}", windows)
    assert batch["teacher_topk_ids"].shape == (windows, SEQ, V)
    common = dict(beta=0.3, temperature=2.0, chunk_size=4, text_key="text", **KEYS)
    online = DistillationObjective(
        student=STUDENT, teacher=TEACHER, teacher_params=teacher, **common
    )
    stored = DistillationObjective(student=STUDENT, stored_teacher=True, **common)
    stored.check_batch(batch)
    params = nn.unbox(jax.jit(online.init)(jax.random.key(0)))["params"]

    def value(objective, frozen):
        def fn(p, batch):
            loss = objective.loss({"params": p, "teacher": frozen}, batch, STEP)[0]
            return loss.value, loss.weight

        return jax.jit(jax.value_and_grad(fn, has_aux=True))

    (want, weight), want_grads = value(online, {"params": teacher})(params, batch)
    (got, got_weight), grads = value(stored, {"params": stored.teacher_weights})(params, batch)
    assert float(got_weight) == float(weight) == sum(len(c) + 1 for _, c in ROWS)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * largest),
        grads,
        want_grads,
    )


def test_stored_top_8_loss_matches_numpy_on_the_teachers_logits(cache):
    root, teacher, windows = cache
    batch = stored_batch(root / "k8", windows)
    assert TeacherTopK(root / "k8").temperature == 2.0 and TeacherTopK(root / "k8").k == 8
    objective = DistillationObjective(
        student=STUDENT, stored_teacher=True, beta=0.5, temperature=2.0, text_key="text", **KEYS
    )
    params = nn.unbox(jax.jit(objective.init)(jax.random.key(0)))["params"]
    loss, metrics = jax.jit(objective.loss)(
        {"params": params, "teacher": {"params": objective.teacher_weights}}, batch, STEP
    )
    extra = dict(segment_ids=batch["segment_ids"][:, :-1], positions=batch["positions"][:, :-1])
    ids = batch["text"][:, :-1]
    zs = np.asarray(jax.jit(STUDENT.apply)({"params": params["policy"]}, ids, **extra))
    zt = np.asarray(jax.jit(TEACHER.apply)({"params": teacher}, ids, **extra))
    d = np_topk_divergence(zs, zt, 8, 0.5, 2.0)
    segments = batch["segment_ids"]
    w = batch["loss_mask"][:, 1:] & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    np.testing.assert_allclose(loss.value, 4.0 * (d * w).sum() / w.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics["divergence"].value, (d * w).sum() / w.sum(), rtol=1e-5)
    agree = (zs.argmax(-1) == zt.argmax(-1)) * w
    np.testing.assert_allclose(metrics["agreement"].value, agree.sum() / w.sum(), rtol=1e-6)


def test_the_reader_resumes_where_it_stopped(cache):
    root, _, windows = cache
    data = TeacherTopK(root / "k8", read_threads=0, seed=3).load(batch=2)
    first = data.train(Partition())
    for _ in range(3):  # into the second epoch
        next(first)
    state = first.get_state()
    want = [next(first) for _ in range(2)]
    again = data.train(Partition())
    again.set_state(state)
    for batch in want:
        got = next(again)
        assert got.keys() == batch.keys()
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key])


def test_a_written_cache_is_never_overwritten_and_bad_options_are_refused(cache):
    root, teacher, _ = cache
    with pytest.raises(FileExistsError, match="already holds a teacher top-k cache"):
        TopKWriter(root / "k8", k=8, temperature=2.0, vocab_size=V)
    with pytest.raises(ValueError, match="pass text_key="):
        DistillationObjective(student=STUDENT, stored_teacher=True)
    with pytest.raises(ValueError, match="no teacher or teacher_params"):
        DistillationObjective(
            student=STUDENT,
            teacher=TEACHER,
            teacher_params=teacher,
            stored_teacher=True,
            text_key="t",
        )
    with pytest.raises(ValueError, match=r"k=0 must be in \[1, the teacher's vocabulary"):
        write_teacher_topk(root / "bad", [], teacher=TEACHER, teacher_params=teacher, k=0)
    with pytest.raises(FileNotFoundError, match="is not a closed teacher top-k cache"):
        TeacherTopK(root / "nothing").load(batch=1)
