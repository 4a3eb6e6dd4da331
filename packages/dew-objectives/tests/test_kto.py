"""KTOObjective: the loss against a numpy transcription of KTO's eq. 7-8 on a
tiny model's log-probs (unequal rows, mismatched pairs built by hand), and bad
input."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives import Step
from dew.objectives.preference.kto import KTOObjective, mismatched

MODEL = CausalTransformer(**TINY_LM)  # vocab 32
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))
ROWS, LENGTH = 5, 12
LABELS = np.array([True, False, True, True, False])


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    batch = {
        "completion": np.zeros((ROWS, LENGTH), np.int32),
        "completion_mask": np.zeros((ROWS, LENGTH), bool),
        "prompt_mask": np.zeros((ROWS, LENGTH), bool),
        "label": LABELS.copy(),
    }
    for r in range(ROWS):
        p, n = int(rng.integers(1, 5)), int(rng.integers(1, 8))
        batch["completion"][r, : p + n] = rng.integers(1, 32, p + n)
        batch["prompt_mask"][r, :p] = True
        batch["completion_mask"][r, p : p + n] = True
    return batch


def numpy_mismatched(batch):
    """Row i: its prompt, then row i + 1's completion (cut to the row), by loops."""
    ids = np.zeros((ROWS, LENGTH), np.int32)
    mask = np.zeros((ROWS, LENGTH), bool)
    for i in range(ROWS):
        j = (i + 1) % ROWS
        prompt = batch["completion"][i][batch["prompt_mask"][i]].tolist()
        completion = batch["completion"][j][batch["completion_mask"][j]].tolist()
        row = (prompt + completion)[:LENGTH]
        ids[i, : len(row)] = row
        mask[i, len(prompt) : len(row)] = True
    return ids, mask


def numpy_logps(params, ids, mask):
    logits = np.asarray(jax.jit(MODEL.apply)({"params": params}, jnp.asarray(ids)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    scored = np.zeros(ids.shape)
    scored[:, 1:] = np.take_along_axis(logits[:, :-1], ids[:, 1:, None], -1)[..., 0] - logz[:, :-1]
    return (scored * mask).sum(-1)


@pytest.fixture(scope="module")
def weights():
    init = jax.jit(MODEL.init)
    ids = jnp.zeros((1, 8), jnp.int32)
    return tuple(nn.unbox(init(jax.random.key(k), ids))["params"] for k in (1, 2))


def test_mismatched_pairs_are_prompt_then_the_next_completion():
    batch = make_batch(3)
    ids, mask = mismatched(
        jnp.asarray(batch["completion"]), batch["prompt_mask"], batch["completion_mask"]
    )
    want_ids, want_mask = numpy_mismatched(batch)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(np.where(want_mask, ids, 0), np.where(want_mask, want_ids, 0))
    prompt = batch["prompt_mask"]
    np.testing.assert_array_equal(np.where(prompt, ids, 0), np.where(prompt, want_ids, 0))


def test_loss_is_kto_eq_7(weights):
    beta, lam_d, lam_u = 0.5, 1.0, 1.3
    batch = make_batch()
    weights_rows = np.array([1.0, 1.0, 0.0, 1.0, 1.0], np.float32)  # one padded row
    batch["example_mask"] = weights_rows
    objective = KTOObjective(
        model=MODEL,
        reference=weights[1],
        beta=beta,
        desirable_weight=lam_d,
        undesirable_weight=lam_u,
    )
    variables = {"params": {"policy": weights[0]}, "reference": {"params": weights[1]}}
    loss, metrics = jax.jit(objective.loss)(variables, batch, STEP)

    policy, reference = weights
    r = numpy_logps(policy, batch["completion"], batch["completion_mask"]) - numpy_logps(
        reference, batch["completion"], batch["completion_mask"]
    )
    other, other_mask = numpy_mismatched(batch)
    gap = numpy_logps(policy, other, other_mask) - numpy_logps(reference, other, other_mask)
    pair_rows = weights_rows * np.roll(weights_rows, -1)  # both rows of a mismatched pair real
    z0 = max(0.0, float(np.sum(gap * pair_rows) / np.sum(pair_rows)))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    losses = [
        lam_d * (1 - sig(beta * (v - z0))) if good else lam_u * (1 - sig(beta * (z0 - v)))
        for v, good in zip(r, LABELS)
    ]
    want = np.sum(np.array(losses) * weights_rows) / weights_rows.sum()
    np.testing.assert_allclose(loss.value, want, rtol=1e-5)
    np.testing.assert_allclose(metrics["kl"].value, z0, rtol=1e-5, atol=1e-6)
    good = weights_rows * LABELS
    np.testing.assert_allclose(
        metrics["reward_desirable"].value, beta * np.sum(r * good) / good.sum(), rtol=1e-5
    )


def test_bad_batches(weights):
    objective = KTOObjective(model=MODEL, reference=weights[1])
    batch = make_batch()
    with pytest.raises(ValueError, match="every row of this batch is desirable; KTO needs both"):
        objective.check_batch({**batch, "label": np.ones(ROWS, bool)})
    with pytest.raises(ValueError, match=r"label.*True \(desirable\) or False"):
        objective.check_batch({**batch, "label": np.array([0, 1, 2, 0, 1])})
    with pytest.raises(KeyError, match=r"reads batch\['label'\] \[rows\]"):
        objective.check_batch({k: v for k, v in batch.items() if k != "label"})
    with pytest.raises(ValueError, match="needs beta > 0"):
        KTOObjective(model=MODEL, beta=0.0)


def test_pairs_are_unpaired(weights):
    """pairs=True on a PreferencePairs batch equals the unpaired rows [c0, r0, c1, ...]
    with the mismatched completions taken from the next pair."""
    rng = np.random.default_rng(4)
    pairs = {k: v[:4] for k, v in make_batch(5).items() if k != "label"}
    rejected = pairs["completion"].copy()
    rejected[pairs["completion_mask"]] = rng.integers(1, 32, int(pairs["completion_mask"].sum()))
    batch = {
        "chosen": pairs["completion"],
        "chosen_mask": pairs["completion_mask"],
        "rejected": rejected,
        "rejected_mask": pairs["completion_mask"],
        "prompt_mask": pairs["prompt_mask"],
    }
    variables = {"params": {"policy": weights[0]}, "reference": {"params": weights[1]}}
    paired = KTOObjective(model=MODEL, reference=weights[1], pairs=True)
    paired.check_batch(batch)
    loss, metrics = jax.jit(paired.loss)(variables, batch, STEP)
    # by hand: the rows, their log-ratios, z0 over (prompt of pair i, chosen of pair i + 1)
    ids = np.stack([batch["chosen"], rejected], 1).reshape(8, LENGTH)
    mask = np.stack([batch["chosen_mask"]] * 2, 1).reshape(8, LENGTH)
    r = numpy_logps(weights[0], ids, mask) - numpy_logps(weights[1], ids, mask)
    prompt = np.repeat(batch["prompt_mask"], 2, axis=0)
    other_ids, other_mask = mismatched(jnp.asarray(ids), prompt, mask, shift=2)
    gap = numpy_logps(weights[0], np.asarray(other_ids), np.asarray(other_mask)) - numpy_logps(
        weights[1], np.asarray(other_ids), np.asarray(other_mask)
    )
    z0 = max(0.0, gap.mean())
    label = np.tile([True, False], 4)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    want = np.where(label, 1 - sig(0.1 * (r - z0)), 1 - sig(0.1 * (z0 - r))).mean()
    np.testing.assert_allclose(loss.value, want, rtol=1e-5)
    # shift 2: row 0's (pair 0's chosen) mismatched completion is pair 1's chosen
    c1 = batch["chosen"][1][batch["chosen_mask"][1]]
    p0 = int(batch["prompt_mask"][0].sum())
    np.testing.assert_array_equal(np.asarray(other_ids[0])[p0 : p0 + len(c1)], c1[: LENGTH - p0])


def test_init_reads_the_length_from_the_spec():
    spec = {"chosen": jnp.zeros((LENGTH,), jnp.int32)}
    variables = KTOObjective(model=MODEL, pairs=True).init(jax.random.key(0), spec=spec)
    assert set(variables) == {"params", "reference"}
