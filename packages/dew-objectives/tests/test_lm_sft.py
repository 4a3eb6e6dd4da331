"""LMObjective on SFTExamples: the loss is the completion-token mean (numpy, each
example run alone), and packed rows give the loss and gradients of the same
examples one a row. A GPT-2-style model (learned positions), so positions that
did not restart per example would change the numbers."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from dew.data import ByteTokenizer, Partition, SFTExamples
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_GPT2
from dew.objectives import Step
from dew.objectives.language.lm import LMObjective

SEQ = 31
MODEL = CausalTransformer(**{**TINY_GPT2, "vocab_size": 264, "max_seq_len": SEQ})
STEP = Step(index=np.int32(0), key=jax.random.key(0))
ROWS = [("2+2=", "4"), ("say hi: ", "hi there"), ("x", "yz"), ("a long question? ", "no")]
KEYS = dict(loss_mask_key="loss_mask", segment_ids_key="segment_ids", positions_key="positions")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("sft") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS))

    def batch(packing):
        reader = SFTExamples(path, seq_len=SEQ, packing=packing, read_threads=0)
        data = reader.load(batch=2 if packing else 4)
        return next(data.train(Partition()))

    objective = LMObjective(model=MODEL, seq_len=SEQ, **KEYS)
    variables = nn.unbox(jax.jit(objective.init)(jax.random.key(0)))

    # one program per batch shape: the weighted loss and the gradient of its value
    def value(variables, batch):
        loss = objective.loss(variables, batch, STEP)[0]
        return loss.value, loss

    step = jax.jit(jax.value_and_grad(value, has_aux=True))
    return objective, variables, batch(True), batch(False), step


def numpy_nll(logits, targets):
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_loss_is_the_completion_token_mean(setup):
    objective, variables, packed, _, step = setup
    assert packed["segment_ids"].max() > 1  # several examples share a row
    tokenizer, total, count = ByteTokenizer(), 0.0, 0
    # each example alone in a row of its own, right-padded (a causal model's logits
    # of a sequence do not depend on what follows it): one program
    examples = [
        tokenizer.encode(prompt) + tokenizer.encode(completion) + [tokenizer.end_id]
        for prompt, completion in ROWS
    ]
    rows = np.full((len(ROWS), SEQ + 1), tokenizer.pad_id, np.int32)
    for row, ids in zip(rows, examples, strict=True):
        row[: len(ids)] = ids
    logits = jax.jit(MODEL.apply)({"params": variables["params"]["policy"]}, rows[:, :-1])
    for row, ids, (prompt, _) in zip(range(len(ROWS)), examples, ROWS, strict=True):
        nll = numpy_nll(logits[row, : len(ids) - 1], np.asarray(ids[1:]))
        trained = nll[len(prompt) - 1 :]  # targets: the completion's ids and the end id
        total, count = total + trained.sum(), count + trained.size
    (_, got), _ = step(variables, packed)
    assert float(got.weight) == count == sum(len(c) + 1 for _, c in ROWS)
    assert float(got.value) == pytest.approx(total / count, rel=1e-5)
    objective.check_batch(packed)


def test_packed_rows_give_the_loss_and_gradients_of_unpacked(setup):
    _, variables, packed, unpacked, step = setup
    assert packed["text"].shape[0] < unpacked["text"].shape[0]
    (_, a), grads = step(variables, packed)
    (_, b), want = step(variables, unpacked)
    assert float(a.weight) == float(b.weight)
    assert float(a.value) == pytest.approx(float(b.value), rel=1e-6)
    # 1e-5 relative, and 1e-6 of the largest gradient absolute: some entries (the key
    # bias, whose exact gradient is 0) hold float32 noise of either order
    largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * largest),
        grads,
        want,
    )


def test_targets_across_segments_never_count(setup):
    """Without the reader's loss mask, the segment ids alone drop the target that
    starts a new example and those on padding: each example of n ids has n - 1."""
    _, _, packed, _, _ = setup
    objective = LMObjective(model=MODEL, seq_len=SEQ, segment_ids_key="segment_ids")
    weights = np.asarray(objective._weights(packed, packed["text"]))
    segments = packed["segment_ids"]
    lengths = [(row == s).sum() for row in segments for s in np.unique(row[row > 0])]
    assert len(lengths) == len(ROWS)
    assert weights.sum() == sum(n - 1 for n in lengths)
    assert not weights[segments[:, 1:] != segments[:, :-1]].any()


def test_positions_outside_the_model_are_refused(setup):
    objective, _, packed, _, _ = setup
    bad = {**packed, "positions": packed["positions"] + SEQ}
    with pytest.raises(ValueError, match=r"batch\['positions'\] holds positions from"):
        objective.check_batch(bad)
