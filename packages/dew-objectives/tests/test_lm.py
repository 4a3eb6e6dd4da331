"""LMObjective: the loss against numpy, masks, evaluation sums, bad batches."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.objectives import Step
from dew.objectives.contract import weighted
from dew.objectives.language.lm import LMObjective

MODEL = CausalTransformer(
    vocab_size=24, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16
)
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))


@pytest.fixture(scope="module")
def setup():
    objective = LMObjective(model=MODEL, seq_len=8)
    variables = nn.unbox(objective.init(jax.random.key(0)))
    tokens = np.random.default_rng(0).integers(0, 24, (4, 9)).astype(np.int32)
    return objective, variables, tokens


def as_model(variables):
    """The policy's variables as the model reads them."""
    return {"params": variables["params"]["policy"]}


def numpy_nll(logits, targets):
    logits = np.asarray(logits, np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_loss_is_mean_next_token_nll(setup):
    objective, variables, tokens = setup
    loss, metrics = objective.loss(variables, {"text": tokens}, STEP)
    logits = MODEL.apply(as_model(variables), tokens[:, :-1])
    nll = numpy_nll(logits, tokens[:, 1:])
    assert float(loss.value) == pytest.approx(nll.mean(), rel=1e-5)
    assert float(loss.total) == pytest.approx(nll.sum(), rel=1e-5)
    assert float(loss.weight) == 4 * 8
    assert float(metrics["nll"].value) == pytest.approx(nll.mean(), rel=1e-5)
    assert float(metrics["tokens"].total) == 4 * 8


def test_loss_mask_and_example_mask_weight_the_sums(setup):
    objective, variables, tokens = setup
    masked = LMObjective(model=MODEL, seq_len=8, loss_mask_key="completion")
    completion = np.zeros((4, 9), np.int32)
    completion[:, 5:] = 1
    example_mask = np.array([True, True, False, True])
    batch = {"text": tokens, "completion": completion, "example_mask": example_mask}
    loss, metrics = masked.loss(variables, batch, STEP)
    nll = numpy_nll(MODEL.apply(as_model(variables), tokens[:, :-1]), tokens[:, 1:])
    weights = completion[:, 1:] * example_mask[:, None]
    assert float(loss.value) == pytest.approx((nll * weights).sum() / weights.sum(), rel=1e-5)
    assert float(loss.weight) == weights.sum()
    assert float(metrics["tokens"].total) == weights.sum()


def test_evaluate_sums_add_up_over_batches(setup):
    objective, variables, tokens = setup
    whole = objective.evaluate(variables, {"text": tokens}, STEP)
    halves = [objective.evaluate(variables, {"text": t}, STEP) for t in (tokens[:2], tokens[2:])]
    totals = weighted.add(*halves)
    for key in whole:
        assert float(totals[key].total) == pytest.approx(float(whole[key].total), rel=1e-5)
    summary = objective.summarize(weighted.to_float(totals))
    logits = MODEL.apply(as_model(variables), tokens[:, :-1])
    nll = numpy_nll(logits, tokens[:, 1:])
    assert summary["loss"] == pytest.approx(nll.mean(), rel=1e-5)
    assert summary["perplexity"] == pytest.approx(np.exp(nll.mean()), rel=1e-5)
    accuracy = (np.argmax(logits, -1) == tokens[:, 1:]).mean()
    assert summary["accuracy"] == pytest.approx(accuracy)


def test_bad_batches_are_named(setup):
    objective, _, tokens = setup
    with pytest.raises(ValueError, match=r"rows of seq_len \+ 1 = 9 ids"):
        objective.check_batch({"text": tokens[:, :8]})
    bad = tokens.copy()
    bad[1, 3] = 30
    with pytest.raises(ValueError, match="token id 30 .*vocab_size 24, largest id 30"):
        objective.check_batch({"text": bad})
    with pytest.raises(KeyError, match=r"reads batch\['text'\].*it has \['tokens'\]"):
        objective.check_batch({"tokens": tokens})
    with pytest.raises(ValueError, match="need 32 positions, more than the model's max_seq_len 16"):
        LMObjective(model=MODEL, seq_len=32)


def test_init_params_start_from_given_weights(setup):
    objective, variables, _ = setup
    shifted = jax.tree.map(lambda x: x + 1.0, variables["params"]["policy"])
    tuned = LMObjective(model=MODEL, seq_len=8, init_params=shifted)
    got = nn.unbox(tuned.init(jax.random.key(5)))["params"]["policy"]
    jax.tree.map(np.testing.assert_array_equal, got, shifted)


def test_logits_in_chunks_give_todays_loss_gradient_and_evaluation(setup):
    _, variables, tokens = setup
    rng = np.random.default_rng(2)
    mask = rng.integers(0, 2, (4, 9)).astype(np.int32)  # unequal weights per row
    mask[:, -1] = 1
    segments = np.repeat(np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0]]), 4, axis=0)
    positions = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 0]] * 4, np.int32)
    batch = {
        "text": tokens,
        "mask": mask,
        "segments": segments,
        "positions": positions,
        "example_mask": np.array([True, True, False, True]),
    }
    keys = dict(loss_mask_key="mask", segment_ids_key="segments", positions_key="positions")
    whole = LMObjective(model=MODEL, seq_len=8, **keys)
    chunked = LMObjective(
        model=MODEL, seq_len=8, logits_chunk_size=3, **keys
    )  # 3 does not divide 8

    def loss(objective, params):
        return objective.loss({"params": params}, batch, STEP)[0].value

    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(whole, p)))(variables["params"])
    chunked_value, chunked_grads = jax.jit(jax.value_and_grad(lambda p: loss(chunked, p)))(
        variables["params"]
    )
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-6)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    results = chunked.evaluate(variables, batch, STEP)
    for name, metric in whole.evaluate(variables, batch, STEP).items():
        assert float(results[name].total) == pytest.approx(float(metric.total), rel=1e-6), name
        assert getattr(results[name], "weight", None) == getattr(metric, "weight", None), name


@pytest.mark.parametrize("bad", [0, 2.0, "64"])
def test_a_bad_logits_chunk_size_is_refused_when_built(bad):
    with pytest.raises(ValueError, match=r"LMObjective: logits_chunk_size must be .*got"):
        LMObjective(model=MODEL, seq_len=8, logits_chunk_size=bad)


def test_logits_in_chunks_need_a_model_that_scores_targets():
    class Plain(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            return nn.Embed(24, 24)(tokens)

    with pytest.raises(ValueError, match=r"Plain takes no logits_chunk_size; use .*None"):
        LMObjective(model=Plain(), seq_len=8, logits_chunk_size=4)
