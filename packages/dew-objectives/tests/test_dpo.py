"""DPOObjective: each loss against a numpy computation, padding invariance,
precomputed reference log-probs, the reader's batches, bad input."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives import Step
from dew.objectives.preference.dpo import DPOObjective

MODEL = CausalTransformer(**TINY_LM)  # vocab 32, max_seq_len 32
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))
PAIRS, LENGTH = 4, 12


def make_batch(seed=0, length=LENGTH, pad_id=0):
    """Prompts of 2..4 ids, completions of 1..6 ids, right padding."""
    rng = np.random.default_rng(seed)
    batch = {k: np.full((PAIRS, length), pad_id, np.int32) for k in ("chosen", "rejected")}
    for k in ("chosen_mask", "rejected_mask", "prompt_mask"):
        batch[k] = np.zeros((PAIRS, length), bool)
    for r in range(PAIRS):
        p = int(rng.integers(2, 5))
        prompt = rng.integers(1, 32, p)
        for name in ("chosen", "rejected"):
            n = int(rng.integers(1, 7))
            batch[name][r, :p] = prompt
            batch[name][r, p : p + n] = rng.integers(1, 32, n)
            batch[f"{name}_mask"][r, p : p + n] = True
        batch["prompt_mask"][r, :p] = True
    return batch


@pytest.fixture(scope="module")
def weights():
    init = jax.jit(MODEL.init)
    ids = jnp.zeros((1, 8), jnp.int32)
    policy = nn.unbox(init(jax.random.key(1), ids))["params"]
    reference = nn.unbox(init(jax.random.key(2), ids))["params"]
    return policy, reference


def numpy_logps(params, ids, mask):
    """Sum over completion positions t of log softmax(logits[t - 1])[ids[t]], float64."""
    logits = np.asarray(jax.jit(MODEL.apply)({"params": params}, jnp.asarray(ids)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    scored = np.zeros(ids.shape)  # logits at t - 1 predict ids[t]; position 0 is never scored
    scored[:, 1:] = np.take_along_axis(logits[:, :-1], ids[:, 1:, None], -1)[..., 0] - logz[:, :-1]
    return (scored * mask).sum(-1)


def numpy_dpo(weights, batch, *, beta, loss_type, eps=0.0):
    policy, reference = weights
    pw = numpy_logps(policy, batch["chosen"], batch["chosen_mask"])
    pl = numpy_logps(policy, batch["rejected"], batch["rejected_mask"])
    rw = numpy_logps(reference, batch["chosen"], batch["chosen_mask"])
    rl = numpy_logps(reference, batch["rejected"], batch["rejected_mask"])
    h = (pw - rw) - (pl - rl)
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
    return losses, beta * (pw - rw), beta * (pl - rl), (pw, pl, rw, rl)


def objective(weights, **kw):
    return DPOObjective(model=MODEL, reference=weights[1], **kw)


def variables_of(weights):
    return {"params": {"policy": weights[0]}, "reference": {"params": weights[1]}}


@pytest.fixture(scope="module")
def rpo_loss(weights):
    """The compiled loss of DPO (sigmoid, beta 0.1) + 0.5 x the chosen NLL, shared."""
    return jax.jit(objective(weights, rpo_alpha=0.5).loss)


def test_loss_metrics_and_rpo_term_match_numpy(weights, rpo_loss):
    batch = make_batch()
    (loss, nll), metrics = rpo_loss(variables_of(weights), batch, STEP)
    losses, r_w, r_l, (pw, pl, _, _) = numpy_dpo(weights, batch, beta=0.1, loss_type="sigmoid")
    assert float(loss.weight) == PAIRS
    assert float(loss.value) == pytest.approx(losses.mean(), rel=1e-5, abs=1e-6)
    assert float(metrics["reward_chosen"].value) == pytest.approx(r_w.mean(), abs=1e-5)
    assert float(metrics["reward_rejected"].value) == pytest.approx(r_l.mean(), abs=1e-5)
    assert float(metrics["margin"].value) == pytest.approx((r_w - r_l).mean(), abs=1e-5)
    assert float(metrics["accuracy"].value) == pytest.approx(np.mean(r_w > r_l))
    assert float(metrics["logp_chosen"].value) == pytest.approx(pw.mean(), rel=1e-5)
    assert float(metrics["logp_rejected"].value) == pytest.approx(pl.mean(), rel=1e-5)
    assert float(metrics["pairs"].total) == PAIRS
    # RPO: a second term, the mean NLL per chosen token, weighted by those tokens
    tokens = batch["chosen_mask"].sum()
    assert float(nll.weight) == tokens
    assert float(nll.value) == pytest.approx(0.5 * -pw.sum() / tokens, rel=1e-5)
    assert float(metrics["nll_chosen"].value) == pytest.approx(-pw.sum() / tokens, rel=1e-5)


def test_ipo_loss_matches_numpy(weights):
    obj = objective(weights, loss_type="ipo", beta=0.3)
    batch = make_batch(1)
    loss, metrics = jax.jit(obj.loss)(variables_of(weights), batch, STEP)
    losses, r_w, r_l, _ = numpy_dpo(weights, batch, beta=0.3, loss_type="ipo")
    assert float(loss.value) == pytest.approx(losses.mean(), rel=1e-5)
    assert float(metrics["margin"].value) == pytest.approx((r_w - r_l).mean(), abs=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        dict(loss_type="sigmoid", beta=0.1),
        dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.2),
        dict(loss_type="cdpo", beta=0.1, label_smoothing=0.1),
        dict(loss_type="ipo", beta=0.3),
    ],
    ids=lambda c: f"{c['loss_type']}-{c.get('label_smoothing', 0)}",
)
def test_pair_losses_closed_form(case):
    """Each variant's per-pair loss of h, against its formula written out."""
    h = np.array([-30.0, -2.0, -0.1, 0.0, 0.3, 4.0, 50.0])
    beta, eps = case["beta"], case.get("label_smoothing", 0.0)
    got = np.asarray(DPOObjective(model=MODEL, **case).pair_losses(jnp.asarray(h, jnp.float32)))
    if case["loss_type"] == "ipo":
        want = (h - 1 / (2 * beta)) ** 2
    else:
        sig = 1 / (1 + np.exp(-beta * h))
        want = -(1 - eps) * np.log(sig) - eps * np.log(1 - sig)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if case["loss_type"] != "ipo":  # h = 0 (policy = reference): log 2 whatever eps
        assert got[3] == pytest.approx(np.log(2.0), rel=1e-6)


def test_more_padding_and_other_pad_ids_give_the_same_loss(weights, rpo_loss):
    (want, want_nll), _ = rpo_loss(variables_of(weights), make_batch(2), STEP)
    (got, got_nll), _ = rpo_loss(variables_of(weights), make_batch(2, length=24, pad_id=7), STEP)
    assert float(got.value) == pytest.approx(float(want.value), rel=1e-6, abs=1e-7)
    assert float(got_nll.value) == pytest.approx(float(want_nll.value), rel=1e-6)
    assert float(got_nll.weight) == float(want_nll.weight)


def test_precomputed_reference_logps_and_reference_free(weights, rpo_loss):
    batch = make_batch(3)
    _, _, _, (pw, pl, rw, rl) = numpy_dpo(weights, batch, beta=0.1, loss_type="sigmoid")
    obj = objective(weights)
    (computed, _), _ = rpo_loss(variables_of(weights), batch, STEP)
    given = dict(
        batch, ref_chosen_logps=rw.astype(np.float32), ref_rejected_logps=rl.astype(np.float32)
    )
    obj.check_batch(given)
    # the reference weights are not read: zeros in their place change nothing
    zeros = {
        "params": {"policy": weights[0]},
        "reference": jax.tree.map(jnp.zeros_like, {"params": weights[1]}),
    }
    precomputed, _ = jax.jit(obj.loss)(zeros, given, STEP)
    assert float(precomputed.value) == pytest.approx(float(computed.value), rel=1e-5)
    free = DPOObjective(model=MODEL, reference_free=True)
    assert [r.name for r in free.roles()] == ["policy"]
    loss, _ = jax.jit(free.loss)({"params": {"policy": weights[0]}}, batch, STEP)
    h = pw - pl
    assert float(loss.value) == pytest.approx(np.mean(np.logaddexp(0.0, -0.1 * h)), rel=1e-5)


def test_init_copies_the_initial_policy_or_takes_given_weights(weights):
    obj = DPOObjective(model=MODEL, init_params=weights[0])
    variables = nn.unbox(jax.jit(obj.init)(jax.random.key(5)))
    jax.tree.map(np.testing.assert_array_equal, variables["params"]["policy"], weights[0])
    jax.tree.map(np.testing.assert_array_equal, variables["reference"]["params"], weights[0])
    roles = obj.roles()
    assert [(r.name, r.trained) for r in roles] == [("policy", True), ("reference", False)]
    # declared: without reference weights the reference is the initial policy
    assert roles[1].initial_from == "policy"
    assert objective(weights).roles()[1].initial_from is None
    given = nn.unbox(jax.jit(objective(weights).init)(jax.random.key(5)))
    jax.tree.map(np.testing.assert_array_equal, given["reference"]["params"], weights[1])
    # boxes kept: the reference is sharded like the policy
    boxed = jax.eval_shape(objective(weights).init, jax.random.key(5))["reference"]["params"]
    assert isinstance(boxed["embed"]["embedding"], nn.meta.AxisMetadata)


def test_reader_batches_train_and_name_bad_pairs(tmp_path):
    from dew.data import ByteTokenizer, PreferencePairs

    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": "hi", "chosen": "hello", "rejected": "go away"},
        {"prompt": "a", "chosen": "b", "rejected": "b"},  # a tie: refused
        {"prompt": "x", "chosen": "yz", "rejected": "y"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = PreferencePairs(str(path), prompt_len=4, completion_len=8, read_threads=0).load(batch=4)
    batch = next(data.train(_partition()))
    model = CausalTransformer(**dict(TINY_LM, vocab_size=ByteTokenizer.vocab_size))
    obj = DPOObjective(model=model)
    with pytest.raises(
        ValueError, match=r"pair \d of this batch has identical chosen and rejected"
    ):
        obj.check_batch(batch)
    keep = ~np.all(batch["chosen"] == batch["rejected"], axis=1)
    good = {k: v[keep] for k, v in batch.items()}
    obj.check_batch(good)
    variables = nn.unbox(jax.jit(obj.init)(jax.random.key(0)))
    loss, metrics = jax.jit(obj.loss)(variables, good, STEP)
    # policy == reference at init: h = 0 for every pair, loss log 2, margin 0
    assert float(loss.value) == pytest.approx(np.log(2.0), rel=1e-6)
    assert float(metrics["margin"].value) == 0.0 and float(metrics["accuracy"].value) == 0.0
    # prompt ids are never counted: the chosen log-prob covers completion + end id only
    counted = sorted(good["chosen_mask"].sum(1).tolist())
    assert counted == sorted(len(r["chosen"]) + 1 for r in (rows[0], rows[1], rows[3]))
    assert not np.any(good["chosen_mask"] & good["prompt_mask"])


def _partition():
    from dew.data import Partition

    return Partition(0, 1)


def test_bad_input_is_refused_before_compiling(weights):
    obj = objective(weights)
    empty = make_batch()
    empty["rejected_mask"][2] = False
    with pytest.raises(ValueError, match=r"pair 2 of this batch has an empty rejected completion"):
        obj.check_batch(empty)
    tie = make_batch()
    tie["rejected"][1], tie["rejected_mask"][1] = tie["chosen"][1], tie["chosen_mask"][1]
    with pytest.raises(ValueError, match=r"pair 1 of this batch has identical chosen and rejected"):
        obj.check_batch(tie)
    tie["example_mask"] = np.array([1, 0, 1, 1], bool)  # a padded row may be a tie
    obj.check_batch(tie)
    no_prompt = make_batch()
    no_prompt["chosen_mask"][0, 0] = True
    with pytest.raises(ValueError, match=r"pair 0's chosen completion starts at position 0"):
        obj.check_batch(no_prompt)
    with pytest.raises(KeyError, match=r"reads batch\['rejected_mask'\].*does not have"):
        obj.check_batch({k: v for k, v in make_batch().items() if k != "rejected_mask"})
    with pytest.raises(ValueError, match="need both"):
        obj.check_batch(dict(make_batch(), ref_chosen_logps=np.zeros(PAIRS, np.float32)))
    wide = make_batch(length=40)
    with pytest.raises(ValueError, match="more than the model's max_seq_len 32"):
        obj.check_batch(wide)
    other_vocab = CausalTransformer(**dict(TINY_LM, vocab_size=64))
    with pytest.raises(ValueError, match=r"reference's vocabulary \(64 ids\) differs .* \(32\)"):
        DPOObjective(model=MODEL, reference_model=other_vocab, reference=weights[1])
    wider = CausalTransformer(**dict(TINY_LM, emb_features=32))
    wrong = nn.unbox(jax.jit(wider.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    with pytest.raises(ValueError, match=r"DPOObjective reference.*\['embed'\]\['embedding'\]"):
        jax.eval_shape(DPOObjective(model=MODEL, reference=wrong["params"]).init, jax.random.key(0))
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        DPOObjective(model=MODEL, loss_type="cdpo")
    with pytest.raises(ValueError, match="takes no label_smoothing"):
        DPOObjective(model=MODEL, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(
        ValueError, match=r"use one of \['sigmoid', 'cdpo', 'ipo', 'simpo', 'orpo'\]"
    ):
        DPOObjective(model=MODEL, loss_type="hinge")


def test_export_is_a_text_generation_of_the_policy(weights):
    from dew.sampling import TextGeneration

    task = objective(weights).export(variables_of(weights))
    assert isinstance(task, TextGeneration) and task.params is weights[0]


def test_logits_in_chunks_give_todays_loss_and_gradient(weights, rpo_loss):
    batch = make_batch()
    chunked = objective(weights, rpo_alpha=0.5, logits_chunk_size=3)

    def total(loss_fn, params):
        terms, _ = loss_fn({**variables_of(weights), "params": {"policy": params}}, batch, STEP)
        return sum(t.value for t in terms)

    value, grads = jax.jit(jax.value_and_grad(lambda p: total(rpo_loss, p)))(weights[0])
    chunked_value, chunked_grads = jax.jit(jax.value_and_grad(lambda p: total(chunked.loss, p)))(
        weights[0]
    )
    assert float(chunked_value) == pytest.approx(float(value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="DPOObjective: logits_chunk_size must be"):
        objective(weights, logits_chunk_size=0)


# ------------------------------------------- SimPO, ORPO (issue 43)
@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_match_their_papers(weights, loss_type):
    """SimPO eq. 6 and ORPO eq. 4-7 written out over numpy log-probs of unequal
    completions (per-token means), with one padded pair; no reference role."""
    policy_params, _ = weights
    beta = 2.0 if loss_type == "simpo" else 0.1
    extra = dict(simpo_gamma=0.4) if loss_type == "simpo" else {}
    obj = DPOObjective(model=MODEL, loss_type=loss_type, beta=beta, **extra)
    assert [r.name for r in obj.roles()] == ["policy"]  # no reference role is created
    batch = make_batch(2)
    rows = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
    out, metrics = jax.jit(obj.loss)(
        {"params": {"policy": policy_params}}, {**batch, "example_mask": rows}, STEP
    )
    pw = numpy_logps(policy_params, batch["chosen"], batch["chosen_mask"])
    pl = numpy_logps(policy_params, batch["rejected"], batch["rejected_mask"])
    aw, al = pw / batch["chosen_mask"].sum(1), pl / batch["rejected_mask"].sum(1)
    log_sigmoid = lambda x: -np.logaddexp(0.0, -x)  # noqa: E731
    if loss_type == "simpo":
        losses = -log_sigmoid(beta * aw - beta * al - 0.4)
        loss = out
    else:
        log_odds = lambda a: a - np.log1p(-np.exp(a))  # noqa: E731
        losses = -beta * log_sigmoid(log_odds(aw) - log_odds(al))
        loss, nll = out
        tokens = (batch["chosen_mask"].sum(1) * rows).sum()
        assert float(nll.value) == pytest.approx(-(pw * rows).sum() / tokens, rel=1e-5)
    assert float(loss.value) == pytest.approx((losses * rows).sum() / rows.sum(), rel=1e-5)
    margin = beta * (aw - al)
    assert float(metrics["margin"].value) == pytest.approx((margin * rows).sum() / 3, rel=1e-4)


def test_reference_free_losses_refuse_a_reference(weights):
    with pytest.raises(ValueError, match="'simpo'\\) is reference-free: the reference is unused"):
        DPOObjective(model=MODEL, loss_type="simpo", reference=weights[1])
    with pytest.raises(ValueError, match="'orpo'\\) takes no label_smoothing or rpo_alpha"):
        DPOObjective(model=MODEL, loss_type="orpo", rpo_alpha=0.5)
    with pytest.raises(ValueError, match="simpo_gamma is SimPO's margin"):
        DPOObjective(model=MODEL, simpo_gamma=1.0)
