"""DistillationObjective on SFTExamples rows (the reader LMObjective trains on): packed
rows give the loss and gradients of the same examples one a row, and the loss is the
completion-token mean of the divergence of each example run alone (numpy float64).
GPT-2-style models (learned positions), so positions that did not restart per example,
or attention across examples, would change the numbers."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest

from dew.data import ByteTokenizer, Partition, SFTExamples
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_GPT2
from dew.objectives import Step
from dew.objectives.language.distillation import DistillationObjective

SEQ = 31
STUDENT = CausalTransformer(**{**TINY_GPT2, "vocab_size": 264, "max_seq_len": SEQ})
TEACHER = STUDENT.clone(emb_features=2 * STUDENT.emb_features, tie_embeddings=False)
STEP = Step(index=np.int32(0), key=jax.random.key(0))
ROWS = [("2+2=", "4"), ("say hi: ", "hi there"), ("x", "yz"), ("a long question? ", "no")]
KEYS = dict(
    text_key="text",
    loss_mask_key="loss_mask",
    segment_ids_key="segment_ids",
    positions_key="positions",
)
BETA, TEMPERATURE = 0.3, 2.0


def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS))

    def batch(packing):
        reader = SFTExamples(path, seq_len=SEQ, packing=packing, read_threads=0)
        rows = next(reader.load(batch=2 if packing else 4).train(Partition()))
        # the packed rows then two rows of padding (segment 0, masked): the shape of the
        # unpacked batch, so both run through one compiled program
        return {k: np.concatenate([v, np.zeros_like(v)]) if packing else v for k, v in rows.items()}

    ids = np.zeros((1, SEQ), np.int32)
    teacher = nn.unbox(jax.jit(TEACHER.init)(jax.random.key(2), ids))["params"]
    teacher = jax.tree.map(lambda x: 3.0 * x, teacher)  # sharper than its init
    objective = DistillationObjective(
        student=STUDENT,
        teacher=TEACHER,
        teacher_params=teacher,
        beta=BETA,
        temperature=TEMPERATURE,
        chunk_size=8,
        **KEYS,
    )
    variables = nn.unbox(jax.jit(objective.init)(jax.random.key(0)))

    def value(params, batch):
        loss = objective.loss({**variables, "params": params}, batch, STEP)[0]
        return loss.value, loss

    step = jax.jit(jax.value_and_grad(value, has_aux=True))
    return objective, variables, batch(True), batch(False), step


def test_packed_rows_give_the_loss_and_gradients_of_unpacked(setup):
    objective, variables, packed, unpacked, step = setup
    assert packed["segment_ids"].max() > 1 and not packed["segment_ids"][2:].any()
    objective.check_batch(packed)
    (_, a), grads = step(variables["params"], packed)
    (_, b), want = step(variables["params"], unpacked)
    assert float(a.weight) == float(b.weight) == sum(len(c) + 1 for _, c in ROWS)
    np.testing.assert_allclose(a.value, b.value, rtol=1e-6)
    # 1e-5 relative and 1e-6 of the largest gradient: float32 sums in another order
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * largest),
        grads,
        want,
    )


def test_loss_is_the_completion_token_mean_of_each_example_alone(setup):
    _, variables, packed, _, step = setup
    tokenizer = ByteTokenizer()
    examples = [tokenizer.encode(p) + tokenizer.encode(c) + [tokenizer.end_id] for p, c in ROWS]
    rows = np.full((len(ROWS), SEQ), tokenizer.pad_id, np.int32)
    for row, ids in zip(rows, examples, strict=True):
        row[: min(len(ids), SEQ)] = ids[:SEQ]
    zs = np.asarray(jax.jit(STUDENT.apply)({"params": variables["params"]["policy"]}, rows))
    zt = np.asarray(jax.jit(TEACHER.apply)(variables["teacher"], rows))
    total, count = 0.0, 0
    for row, (ids, (prompt, _)) in enumerate(zip(examples, ROWS, strict=True)):
        scored = slice(len(prompt) - 1, len(ids) - 1)  # predicting the completion + end id
        s = log_softmax(zs[row, scored] / TEMPERATURE)
        t = log_softmax(zt[row, scored] / TEMPERATURE)
        m = np.log(BETA * np.exp(t) + (1 - BETA) * np.exp(s))
        jsd = BETA * (np.exp(t) * (t - m)).sum(-1) + (1 - BETA) * (np.exp(s) * (s - m)).sum(-1)
        total += (TEMPERATURE**2 * jsd / (BETA * (1 - BETA))).sum()
        count += len(ids) - len(prompt)
    (_, got), _ = step(variables["params"], packed)
    assert float(got.weight) == count
    np.testing.assert_allclose(got.value, total / count, rtol=1e-5)


def test_packed_keys_need_rows_of_ids_and_positions_inside_the_model(setup):
    objective, variables, packed, _, _ = setup
    with pytest.raises(ValueError, match="pass text_key= too"):
        DistillationObjective(
            student=STUDENT, teacher_params=variables["params"]["policy"], segment_ids_key="s"
        )
    with pytest.raises(ValueError, match=r"batch\['positions'\] holds positions from"):
        objective.check_batch({**packed, "positions": packed["positions"] + SEQ})
