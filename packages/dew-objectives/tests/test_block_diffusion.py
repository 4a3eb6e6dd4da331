"""BlockDiffusionObjective (BD3-LM): the vectorised [noisy | clean] pass equals a
per-block recomputation; block_size = L is MDLM's loss and block_size = 1 (t = 1) the
autoregressive NLL of the same network; the times per (row, block); the clipped
schedule's variance search; bad input."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import Transformer, masks
from dew.objectives import Step
from dew.objectives.contract import weighted
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.diffusion.masked import MaskedDiffusionObjective
from dew.sampling.token_diffusion import MaskSchedule

L, V, MASK = 8, 6, 6
MODEL = Transformer(
    vocab_size=V + 1, emb_features=32, num_layers=2, num_heads=2, mlp_features=64, max_seq_len=L
)
X = np.random.default_rng(0).integers(0, V, (3, L)).astype(np.int32)
STEP = Step(index=jnp.int32(0), key=jax.random.key(3))


@pytest.fixture(scope="module")
def params():
    p = nn.unbox(MODEL.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32)))["params"]
    # scaled up so attention is far from uniform and a wrong mask shows
    return jax.tree.map(lambda a: 3.0 * a, p)


def bd3(block_size, **kw):
    return BlockDiffusionObjective(
        model=MODEL, mask_id=MASK, seq_len=L, block_size=block_size, **kw
    )


def per_block_logits(params, z, x, block_size):
    """For each block b the logits of [x^{<b} | z^b] under a block-causal mask, at z^b."""
    out = []
    for b in range(L // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        tokens = jnp.concatenate([x[:, :lo], z[:, lo:hi]], axis=1)
        slots = np.arange(hi)[None]
        visible = masks.block_causal(block_size).allows(slots, slots)
        out.append(
            np.asarray(MODEL.apply({"params": params}, tokens, query_key_mask=visible))[:, lo:]
        )
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("block_size", [2, 4])
def test_vectorised_logits_equal_per_block_recomputation(params, block_size):
    z = np.where(np.random.default_rng(1).random((3, L)) < 0.5, MASK, X)
    positions = np.concatenate([np.arange(L), np.arange(L)])[None].repeat(3, 0)
    vectorised = MODEL.apply(
        {"params": params},
        jnp.concatenate([z, X], axis=1),
        positions=positions,
        query_key_mask=masks.block_diffusion_mask(L, block_size),
    )[:, :L]
    want = per_block_logits(params, jnp.asarray(z), jnp.asarray(X), block_size)
    np.testing.assert_allclose(np.asarray(vectorised), want, atol=1e-5, rtol=1e-5)
    # the objective's own pass reads the same logits (SUBS of them)
    log_probs = bd3(block_size).denoiser_log_probs(params, jnp.asarray(z), X, None, None, None)
    masked = z == MASK
    want_lp = jax.nn.log_softmax(jnp.asarray(want).at[..., MASK].set(-1e6), axis=-1)
    np.testing.assert_allclose(
        np.asarray(log_probs)[masked], np.asarray(want_lp)[masked], atol=2e-5
    )
    # attending to the noisy version of an earlier block (the bug the mask exists for) differs
    wrong = masks.block_causal(block_size).allows(positions[:1], positions[:1])
    leaked = MODEL.apply(
        {"params": params}, jnp.concatenate([z, X], 1), positions=positions, query_key_mask=wrong
    )[:, :L]
    assert np.abs(np.asarray(leaked) - want).max() > 1e-2


def test_block_size_L_is_mdlm_and_block_size_1_is_the_lm_loss(params):
    rng = np.random.default_rng(2)
    t = jnp.asarray(np.repeat(rng.uniform(0.1, 1, (3, 1)), L, 1), jnp.float32)
    noise = jnp.asarray(rng.random((3, L)), jnp.float32)
    mdlm = MaskedDiffusionObjective(
        model=MODEL, mask_id=MASK, seq_len=L, schedule=MaskSchedule(kind="linear")
    )
    want = mdlm.token_terms(params, {"text": X}, t, noise)[0]
    got = bd3(L).token_terms(params, {"text": X}, t, noise)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    # block_size 1, t = 1: every token masked, seeing the clean tokens before it only: a
    # causal LM over [x_0 .. x_{l-1}, mask] read at the mask, one forward pass per position
    terms, valid, masked, _ = bd3(1).token_terms(params, {"text": X}, t, noise)
    assert float(jnp.min(masked)) == 1.0
    nll = []
    for pos in range(L):
        tokens = np.concatenate([X[:, :pos], np.full((3, 1), MASK)], axis=1)
        slots = np.arange(pos + 1)[None]
        causal = masks.causal().allows(slots, slots)
        logits = MODEL.apply({"params": params}, tokens, query_key_mask=causal)
        logits = np.asarray(logits, np.float64)[:, -1]
        logits[:, MASK] = -1e6
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll.append(-log_probs[np.arange(3), X[:, pos]])
    np.testing.assert_allclose(np.asarray(terms), np.stack(nll, 1), rtol=1e-5, atol=1e-6)
    loss, _ = bd3(1).loss({"params": {"policy": params}}, {"text": X}, STEP)
    assert float(loss.value) == pytest.approx(np.mean(nll), rel=1e-5)


class EveryLayerOnEverySlot(Transformer):
    """MODEL computing every layer on all 2L slots, then slicing the output: the
    computation before the last layer was cut to the noisy half's work."""

    def __call__(self, inputs, *, output_length=None, **kw):
        out = super().__call__(inputs, **kw)
        return out if output_length is None else out[:, :output_length]


def test_the_last_layer_on_the_noisy_half_gives_the_full_loss_and_gradients(params):
    """The objective's pass (the last layer's clean half read as keys and values only)
    against every layer on every slot: the loss within 1e-6, the gradients 1e-5."""
    full_model = EveryLayerOnEverySlot(**{f.name: getattr(MODEL, f.name)
                                          for f in dataclasses.fields(MODEL)
                                          if f.name not in ("parent", "name")})  # fmt: skip
    grads = []
    for model in (MODEL, full_model):
        obj = BlockDiffusionObjective(model=model, mask_id=MASK, seq_len=L, block_size=2)
        grad = jax.jit(jax.value_and_grad(
            lambda p, o=obj: o.loss({"params": {"policy": p}}, {"text": X}, STEP)[0].value
        ))  # fmt: skip
        grads.append(grad(params))
    (short_loss, short), (full_loss, full) = grads
    assert float(short_loss) == pytest.approx(float(full_loss), rel=1e-6)
    for (path, got), want in zip(jax.tree.leaves_with_path(short), jax.tree.leaves(full),
                                 strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(path))


def test_times_per_row_and_block_are_antithetic_and_clipped():
    obj = bd3(2, clip=(0.3, 0.8))
    t = np.asarray(obj.draw_times(jax.random.key(0), 3, L))  # [3 rows, 4 blocks]
    assert t.shape == (3, 4) and t.min() >= 0.3 and t.max() <= 0.8
    u = np.sort((t.ravel() - 0.3) / 0.5)
    np.testing.assert_allclose(np.diff(u), np.full(11, 1 / 12), atol=1e-5)
    tokens = np.asarray(obj.token_times(jnp.asarray(t), L))
    np.testing.assert_array_equal(tokens, np.repeat(t, 2, axis=1))
    assert np.all(np.asarray(bd3(1).draw_times(jax.random.key(0), 3, L)) == 1.0)


def test_evaluation_reports_the_bound_and_the_least_variance_clip(params):
    obj = bd3(4, eval_times=2, clip_search=((0.0, 1.0), (0.45, 0.55)))

    def evaluate(p, b, first):  # rows[first:]: their indices in the evaluation set
        step = dataclasses.replace(STEP, rows=first + jnp.arange(len(b["text"])))
        return obj.evaluate({"params": {"policy": p}}, b, step)

    evaluate = jax.jit(evaluate)
    rows = np.concatenate([X, X[::-1]])
    whole = evaluate(params, {"text": rows}, 0)
    parts = weighted.add(
        evaluate(params, {"text": rows[:2]}, 0), evaluate(params, {"text": rows[2:]}, 2)
    )
    for key in whole:
        assert float(parts[key].total) == pytest.approx(float(whole[key].total), rel=1e-5), key
    summary = obj.summarize(weighted.to_float(whole))
    assert 0 < summary["nelbo_stderr"] < summary["nelbo"]
    assert summary["perplexity_bound"] == pytest.approx(np.exp(summary["nelbo"]), rel=1e-6)
    variances = [summary["clip0_variance"], summary["clip1_variance"]]
    best = obj.clip_search[int(np.argmin(variances))]
    assert (summary["clip_beta"], summary["clip_omega"]) == best
    assert min(variances) >= 0


def test_bad_input_is_refused_before_compiling():
    with pytest.raises(ValueError, match=r"rows of 8 ids do not split into blocks of block_size 3"):
        bd3(3)
    with pytest.raises(ValueError, match=r"\(beta, omega\)=\(0.5, 0.5\) must satisfy 0 <= beta"):
        bd3(2, clip=(0.5, 0.5))
    with pytest.raises(ValueError, match=r"\(beta, omega\)=\(-0.1, 0.9\)"):
        bd3(2, clip_search=((-0.1, 0.9),))
    with pytest.raises(ValueError, match=r"must be a pair"):
        bd3(2, clip=0.5)
    # the sampling side: the pipeline, the block sampler, the mask structure, the head
    from dew.sampling.token_diffusion import MaskedSampler, TokenDiffusionGeneration, sample_blocks

    with pytest.raises(ValueError, match=r"length 8 is not a multiple of block_size 3"):
        TokenDiffusionGeneration(model=MODEL, params=None, tokenizer=None, mask_id=MASK,
                                 length=L, block_size=3)  # fmt: skip
    with pytest.raises(ValueError, match=r"length 6 is not a multiple of block_size 4"):
        sample_blocks(MODEL, None, np.zeros((1, 0), np.int32), key=jax.random.key(0),
                      mask_id=MASK, block_size=4, length=6, schedule=MaskSchedule(),
                      sampler=MaskedSampler())  # fmt: skip
    with pytest.raises(ValueError, match=r"the prompt has 9 tokens but the sample is 8"):
        sample_blocks(MODEL, None, np.zeros((1, 9), np.int32), key=jax.random.key(0),
                      mask_id=MASK, block_size=4, length=8, schedule=MaskSchedule(),
                      sampler=MaskedSampler())  # fmt: skip
    pipe = bd3(4).export(
        {"params": {"policy": None}}, sampler=MaskedSampler(num_steps=2, first_hitting=True)
    )
    with pytest.raises(ValueError, match=r"num_steps=2 cannot unmask 4 masked tokens of a block"):
        pipe.sample_ids(np.zeros((1, 0), np.int32), jax.random.key(0))
    with pytest.raises(ValueError, match=r"multiple of block_size: length 8, block_size 3"):
        masks.BlockDiffusionMask(8, 3)
    with pytest.raises(ValueError, match=r"output_length 9 must be in \[1, 8\]"):
        MODEL.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32), output_length=9)
