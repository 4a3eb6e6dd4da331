"""MaskedDiffusionObjective (MDLM): the loss against a float64 numpy transcription, SUBS
(unmasked positions contribute exactly 0), exact accumulation over rows of unequal
weight, an evaluation independent of batch size and device count, the 4-pattern toy
of OBJECTIVES.md section 3 (trained, then sampled), export round trip, bad input."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dew.data import ByteTokenizer
from dew.nn import Transformer
from dew.objectives import Step
from dew.objectives.contract import weighted
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.diffusion.masked import MaskedDiffusionObjective
from dew.sampling import Pretrained
from dew.sampling.token_diffusion import (
    MaskedSampler,
    MaskSchedule,
    TokenDiffusionGeneration,
    sample_masked,
)

L, V = 8, 6  # data ids 0..5, the mask id 6
MASK = V
PATTERNS = np.random.default_rng(0).integers(0, V, (4, L)).astype(np.int32)
MODEL = Transformer(
    vocab_size=V + 1,
    emb_features=32,
    num_layers=2,
    num_heads=2,
    mlp_features=64,
    max_seq_len=L,
    position_embedding="learned",  # RoPE alone cannot tell the positions of an all-mask row
)
STEP = Step(index=jnp.int32(0), key=jax.random.key(3))


def objective(**kw):
    return MaskedDiffusionObjective(model=MODEL, mask_id=MASK, seq_len=L, **kw)


@pytest.fixture(scope="module")
def params():
    return nn.unbox(objective().init(jax.random.key(0)))["params"]["policy"]


def numpy_terms(params, x, valid, t, noise, schedule):
    """Float64 transcription: mask where noise < 1 - alpha_t, SUBS, 1/t-weighted NLL."""
    alpha = 1 - (1 - schedule.eps) * t[:, None]
    masked = (noise < 1 - alpha) & (valid > 0)
    z = np.where(masked, MASK, x)
    logits = np.asarray(MODEL.apply({"params": params}, z), np.float64)
    logits[..., MASK] = -1e6
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, x[..., None], -1)[..., 0]
    return np.where(masked, nll / t[:, None], 0.0) * valid, masked


def test_loss_is_the_weighted_nelbo_and_unmasked_positions_give_exactly_zero(params):
    obj = objective()
    x = PATTERNS[[0, 1, 2, 3, 0, 1]]
    rng = np.random.default_rng(1)
    t, noise = rng.uniform(0.05, 1, 6).astype(np.float32), rng.random((6, L)).astype(np.float32)
    valid = np.ones((6, L))
    terms, got_valid, masked, _ = obj.token_terms(
        params, {"text": x}, jnp.asarray(np.repeat(t[:, None], L, 1)), jnp.asarray(noise)
    )
    want, want_masked = numpy_terms(params, x, valid, t, noise, obj.schedule)
    np.testing.assert_array_equal(np.asarray(masked) > 0, want_masked)
    np.testing.assert_allclose(np.asarray(terms), want, rtol=1e-5, atol=1e-6)
    assert 0 < want_masked.sum() < want_masked.size
    assert np.all(np.asarray(terms)[~want_masked] == 0.0)  # SUBS: exactly 0, not small

    # loss() is the same sum over the token count, with its own draws from the step key
    loss, metrics = obj.loss({"params": {"policy": params}}, {"text": x}, STEP)
    t, noise = (np.asarray(a) for a in obj.draws(STEP, 6, L))
    want, want_masked = numpy_terms(params, x, valid, t, noise, obj.schedule)
    assert float(loss.weight) == 6 * L
    assert float(loss.value) == pytest.approx(want.sum() / (6 * L), rel=1e-5)
    assert float(metrics["masked"].value) == pytest.approx(want_masked.mean(), rel=1e-6)
    # antithetic: the 6 times are one uniform shifted by i / 6 (mod 1), then scaled
    u = (t - obj.time_eps) / (1 - obj.time_eps)
    np.testing.assert_allclose(np.sort(np.diff(np.sort(u))), np.full(5, 1 / 6), atol=1e-5)


def test_accumulation_over_rows_of_unequal_weight_is_exact(params):
    """Two microbatches' totals and gradients, each divided by the global token count,
    add up to the full batch's (rows padded to 8, 1, 8 and 3 real tokens)."""
    obj = objective(attention_mask_key="mask")
    x = PATTERNS
    mask = np.zeros((4, L), np.int32)
    for row, count in enumerate((8, 1, 8, 3)):
        mask[row, :count] = 1
    rng = np.random.default_rng(2)
    t = jnp.asarray(np.repeat(rng.uniform(0.2, 1, (4, 1)), L, 1), jnp.float32)
    noise = jnp.asarray(rng.random((4, L)), jnp.float32)

    @jax.jit
    def total(p, batch, t, noise):
        terms, valid, _, _ = obj.token_terms(p, batch, t, noise)
        return jnp.sum(terms), jnp.sum(valid)

    def part(rows):
        return {"text": x[rows], "mask": mask[rows]}, t[rows], noise[rows]

    grad = jax.jit(jax.grad(lambda p, w, *a: total(p, *a)[0] / w))
    whole_total, whole_weight = total(params, *part(np.arange(4)))
    parts = [part(np.array([0, 1])), part(np.array([2, 3]))]
    assert float(whole_weight) == 20
    totals = [total(params, *a) for a in parts]
    assert sum(float(s) for s, _ in totals) == pytest.approx(float(whole_total), rel=1e-6)
    jax.tree.map(
        lambda a, b, c: np.testing.assert_allclose(b + c, a, rtol=1e-5, atol=1e-7),
        grad(params, whole_weight, *part(np.arange(4))),
        *[grad(params, whole_weight, *a) for a in parts],
    )
    # a mean of the two microbatches' means would not be the token mean
    means = [float(s / w) for s, w in totals]
    assert abs(np.mean(means) - float(whole_total / whole_weight)) > 1e-3


def rows_step(first: int, count: int) -> Step:
    """Evaluation's step for ``count`` rows starting at row ``first`` of the set."""
    return dataclasses.replace(STEP, rows=first + jnp.arange(count, dtype=jnp.int32))


def test_evaluation_does_not_depend_on_batch_size_or_device_count(params):
    obj = objective(eval_times=4)
    rows = np.concatenate([PATTERNS, PATTERNS[::-1]])  # 8 rows
    evaluate = jax.jit(
        lambda p, b, first: obj.evaluate(
            {"params": {"policy": p}}, b, rows_step(first, len(b["text"]))
        )
    )
    whole = evaluate(params, {"text": rows}, 0)
    # outside the trainer (no step.rows) the rows are indexed 0, 1, ...
    plain = jax.jit(lambda p, b: obj.evaluate({"params": {"policy": p}}, b, STEP))(
        params, {"text": rows}
    )
    assert float(plain["nelbo"].total) == pytest.approx(float(whole["nelbo"].total), rel=1e-6)
    parts = weighted.add(
        evaluate(params, {"text": rows[:3]}, 0), evaluate(params, {"text": rows[3:]}, 3)
    )
    for key in whole:
        assert float(parts[key].total) == pytest.approx(float(whole[key].total), rel=1e-6), key
    assert float(whole["tokens"].total) == 8 * L
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sharded = jax.device_put({"text": rows}, NamedSharding(mesh, PartitionSpec("data")))
    eight = evaluate(params, sharded, 0)
    assert float(eight["nelbo"].total) == pytest.approx(float(whole["nelbo"].total), rel=1e-6)
    # equal rows at different indices draw independently (rows 0 and 7 are both pattern 0)
    doubled = evaluate(params, {"text": rows[[0, 0]]}, 0)
    single = evaluate(params, {"text": rows[[0]]}, 0)
    assert float(doubled["nelbo"].total) != pytest.approx(
        2 * float(single["nelbo"].total), rel=1e-4
    )
    other_objective = objective(eval_times=4, eval_seed=1)
    other = jax.jit(lambda p, b: other_objective.evaluate({"params": {"policy": p}}, b, STEP))(
        params, {"text": rows}
    )
    assert float(other["nelbo"].total) != pytest.approx(float(whole["nelbo"].total), rel=1e-4)
    summary = obj.summarize(weighted.to_float(whole))
    assert summary["perplexity_bound"] == pytest.approx(np.exp(summary["nelbo"]), rel=1e-6)
    assert set(summary) == {"nelbo", "nelbo_stderr", "tokens", "perplexity_bound"}
    assert 0 < summary["nelbo_stderr"] < summary["nelbo"]


class ExactPatterns(nn.Module):
    """The exact SUBS denoiser of a uniform mixture of ``patterns`` ``[K, L]``: at each
    masked position, the patterns that agree with every token it may read (MDLM: the
    unmasked tokens of ``z``; BD3-LM: the clean blocks before its own and the unmasked
    tokens of its block) vote for their token, so ``p(x^l | z)`` is exact."""

    patterns: np.ndarray
    vocab_size: int
    mask_id: int
    block_size: int | None = None
    max_seq_len: int = L

    @nn.compact
    def __call__(self, ids, *, output_length=None, **unused):
        self.param("unused", nn.initializers.zeros, ())
        P = jnp.asarray(self.patterns)  # [patterns, length]
        length = P.shape[1]
        if output_length is None:  # MDLM: every position reads all of z
            seen = jnp.broadcast_to(ids[:, None, :], (ids.shape[0], length, length))
        else:  # BD3-LM: [z | x]
            z, x = ids[:, :length], ids[:, length:]
            block = jnp.arange(length) // self.block_size
            before = (block[None, :] < block[:, None])[None]  # [1, query, key]
            same = (block[None, :] == block[:, None])[None]
            seen = jnp.where(before, x[:, None], jnp.where(same, z[:, None], self.mask_id))
        agree = (seen[:, :, None] == P[None, None]) | (seen == self.mask_id)[:, :, None]
        votes = agree.all(-1).astype(jnp.float32)  # [rows, query, patterns]
        counts = jnp.einsum("bqk,kqv->bqv", votes, jax.nn.one_hot(P, self.vocab_size))
        return jnp.where(counts > 0, jnp.log(jnp.maximum(counts, 1e-30)), -1e4)


EXACT_PATTERNS = np.random.default_rng(7).integers(0, V, (32, L)).astype(np.int32)
EXACT_NLL = np.log(32) / L  # nats a token: each row is one of 32 distinct patterns


def exact_bound(obj, rows: int, data_seed: int) -> dict[str, float]:
    """``obj``'s evaluation summary on ``rows`` rows of the 32 patterns, in batches of
    512 with their indices in the set."""
    params = obj.init(jax.random.key(0))
    data = EXACT_PATTERNS[np.random.default_rng(data_seed).integers(0, 32, rows)]
    evaluate = jax.jit(lambda b, first: obj.evaluate(params, b, rows_step(first, len(b["text"]))))
    totals = None
    for first in range(0, rows, 512):
        sums = jax.device_get(evaluate({"text": data[first : first + 512]}, first))
        totals = sums if totals is None else weighted.add(totals, sums)
    return obj.summarize(weighted.to_float(totals))


@pytest.mark.slow
def test_the_bound_is_unbiased_with_an_exact_denoiser():
    """With the exact denoiser the NELBO equals the NLL (log 32 / 8 = 0.433 nats a token):
    for 4 seeds the estimate lies within 3.5 standard errors of it at 2048 rows (one
    shift shared by every row, the old evaluation, gave -7% to +15% whatever the rows:
    a bias of (u - 1/2) (f(1) - f(eps)) / eval_times), and its error shrinks as
    1 / sqrt(rows); BD3-LM's bound too, and with block_size 1 it is the AR NLL exactly."""
    model = ExactPatterns(EXACT_PATTERNS, V + 1, MASK)
    errors = []
    for seed in range(4):
        obj = MaskedDiffusionObjective(model=model, mask_id=MASK, seq_len=L, eval_seed=seed)
        got = exact_bound(obj, 2048, data_seed=seed)
        errors.append((got["nelbo"] - EXACT_NLL) / got["nelbo_stderr"])
        assert abs(errors[-1]) < 3.5, (seed, got, EXACT_NLL)
    assert abs(np.mean(errors)) < 3.5 / np.sqrt(len(errors)), errors  # no shared bias
    small = exact_bound(objective_of(model, 0), 256, data_seed=9)["nelbo_stderr"]
    large = exact_bound(objective_of(model, 0), 4096, data_seed=9)["nelbo_stderr"]
    assert 0.15 < large / small < 0.35, (small, large)  # 1 / sqrt(16) = 0.25
    for seed in range(2):
        bd3 = BlockDiffusionObjective(
            model=ExactPatterns(EXACT_PATTERNS, V + 1, MASK, block_size=2), mask_id=MASK, seq_len=L,
            block_size=2, clip_search=(), eval_seed=seed,
        )  # fmt: skip
        got = exact_bound(bd3, 1024, data_seed=seed)
        assert abs(got["nelbo"] - EXACT_NLL) < 3.5 * got["nelbo_stderr"], (seed, got)
    ar = BlockDiffusionObjective(
        model=ExactPatterns(EXACT_PATTERNS, V + 1, MASK, block_size=1), mask_id=MASK, seq_len=L,
        block_size=1, clip_search=(),
    )  # fmt: skip
    got = exact_bound(ar, 512, data_seed=0)
    assert got["nelbo"] == pytest.approx(EXACT_NLL, rel=1e-5) and got["nelbo_stderr"] < 1e-5


def test_first_hitting_is_exact_and_ancestral_steps_trade_time_for_error():
    """With the exact denoiser of the 32 patterns, first-hitting sampling (one token a
    step) draws only patterns; the ancestral sampler unmasks several tokens in a step,
    each drawn alone given the same z, so it draws rows the source never produces:
    measured 41% of rows at 8 steps, 6.7% at the default 64 (2000 rows)."""
    model = ExactPatterns(EXACT_PATTERNS, V + 1, MASK)
    params = model.init(jax.random.key(0), jnp.zeros((1, L), jnp.int32))

    def foreign(sampler):  # the share of 1000 sampled rows that are no pattern
        ids, _ = jax.jit(
            lambda key: sample_masked(
                lambda z, t: model.apply(params, z), jnp.full((1000, L), MASK, jnp.int32),
                key=key, mask_id=MASK, schedule=MaskSchedule(), sampler=sampler,
            )
        )(jax.random.key(1))  # fmt: skip
        return 1 - (np.asarray(ids)[:, None] == EXACT_PATTERNS[None]).all(-1).any(-1).mean()

    assert foreign(MaskedSampler(num_steps=L, first_hitting=True)) == 0.0
    few, default = foreign(MaskedSampler(num_steps=L)), foreign(MaskedSampler())
    assert few > 0.25 and 0.02 < default < 0.15 and default < few, (few, default)


def objective_of(model, seed):
    return MaskedDiffusionObjective(model=model, mask_id=MASK, seq_len=L, eval_seed=seed)


def test_schedules_weights_and_the_discrete_bound():
    t = np.array([0.1, 0.5, 0.9], np.float32)
    for kind in ("loglinear", "linear"):  # alpha linear in t: weight 1 / t, for any T
        s = MaskSchedule(kind=kind)
        np.testing.assert_allclose(s.weight(t), 1 / t, rtol=1e-6)
        np.testing.assert_allclose(s.discrete_weight(t, 10), 1 / t, rtol=1e-4)
    cosine = MaskSchedule(kind="cosine")
    h = 1e-3
    slope = (cosine.alpha(t + h) - cosine.alpha(t - h)) / (2 * h)  # numerical alpha'
    np.testing.assert_allclose(cosine.weight(t), -slope / (1 - cosine.alpha(t)), rtol=1e-3)
    # a forward difference over 1 / T in float32: 1e-2 (discretisation ~1e-3, rounding ~1e-3)
    np.testing.assert_allclose(cosine.discrete_weight(t, 4000), cosine.weight(t), rtol=1e-2)
    discrete = objective(num_timesteps=10)
    np.testing.assert_allclose(
        discrete.discretised(jnp.asarray([0.01, 0.15, 1.0])), [0.1, 0.2, 1.0]
    )


def train(obj, params, steps: int, seed: int = 1):
    """``steps`` AdamW steps of ``obj`` on the 4 patterns (batch 64), one scan."""
    opt = optax.adamw(1e-3, weight_decay=0.0)

    def run(p, key):
        def step(carry, i):
            p, s = carry
            rows = jax.random.randint(jax.random.fold_in(key, -1 - i), (64,), 0, 4)
            batch = {"text": jnp.asarray(PATTERNS)[rows]}

            def value(p):
                return obj.loss(
                    {"params": {"policy": p}}, batch, Step(index=i, key=jax.random.fold_in(key, i))
                )[0].value

            loss, g = jax.value_and_grad(value)(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), loss

        (p, _), losses = jax.lax.scan(step, (p, opt.init(p)), jnp.arange(steps))
        return p, losses

    return jax.jit(run)(params, jax.random.key(seed))


@pytest.fixture(scope="module")
def trained(params):
    """800 AdamW steps on the 4 patterns (batch 64), compiled as one scan (600 left a
    NELBO of 1.21x or 1.44x the optimum depending on the draws: OBJECTIVES.md section 3)."""
    obj = objective(ema=None)
    return obj, *train(obj, params, 800)


@pytest.fixture(scope="module")
def trained_bd3(trained):
    """BD3-LM (block 2) fine-tuned from the MDLM toy's weights, as BD3-LM fine-tunes an
    MDLM checkpoint (block_size = L is MDLM): 300 AdamW steps on the same patterns."""
    obj = BlockDiffusionObjective(model=MODEL, mask_id=MASK, seq_len=L, block_size=2, ema=None)
    return obj, *train(obj, trained[1], 300, seed=4)


@pytest.mark.slow
def test_four_patterns_nelbo_near_optimum_and_samples_exact(trained):
    obj, params, losses = trained
    batch = {"text": np.repeat(PATTERNS, 8, 0)}
    nelbo = float(
        jax.jit(lambda p: obj.evaluate({"params": {"policy": p}}, batch, STEP))(params)[
            "nelbo"
        ].value
    )
    optimum = np.log(4) / L  # the data's entropy per token
    assert float(losses[:10].mean()) > 1.0
    assert nelbo <= 1.3 * optimum and nelbo < 0.25 * np.log(V), (nelbo, optimum)
    # ancestral with S = 4L steps (OBJECTIVES.md: fewer steps unmask tokens together)
    fn = jax.jit(
        lambda p, key: sample_masked(
            lambda z, t: MODEL.apply({"params": p}, z),
            jnp.full((128, L), MASK, jnp.int32),
            key=key,
            mask_id=MASK,
            schedule=obj.schedule,
            sampler=MaskedSampler(num_steps=4 * L),
        )
    )
    tokens, _ = fn(params, jax.random.key(2))
    tokens = np.asarray(tokens)
    exact = (tokens[:, None] == PATTERNS[None]).all(-1)
    assert exact.any(-1).mean() >= 0.75, exact.any(-1).mean()
    assert exact.sum(0).min() >= 10  # every pattern is drawn, not one mode


@pytest.mark.slow
def test_four_patterns_block_diffusion_nelbo_and_samples_exact(trained_bd3, tmp_path):
    obj, params, losses = trained_bd3
    batch = {"text": np.repeat(PATTERNS, 8, 0)}
    bound = dataclasses.replace(obj, clip_search=())  # the bound alone (16 grid times)
    nelbo = float(
        jax.jit(lambda p: bound.evaluate({"params": {"policy": p}}, batch, STEP))(params)[
            "nelbo"
        ].value
    )
    assert nelbo <= 1.3 * np.log(4) / L and nelbo < 0.25 * np.log(V), nelbo
    # the exported task: block after block, 8 ancestral steps a block, KV cache of clean
    # blocks; saved, Pretrained.load recognises it and samples the same
    pipe = obj.export({"params": {"policy": params}}, sampler=MaskedSampler(num_steps=8))
    assert (pipe.block_size, pipe.use_kv_cache, pipe.length) == (2, True, L)
    key = jax.random.key(2)
    tokens = pipe.sample_ids(np.zeros((128, 0), np.int32), key)
    exact = (tokens[:, None] == PATTERNS[None]).all(-1)
    assert exact.any(-1).mean() >= 0.75, exact.any(-1).mean()
    assert exact.sum(0).min() >= 10  # every pattern is drawn, not one mode
    pipe.save(tmp_path / "bd3")
    again = Pretrained.load(tmp_path / "bd3").pipeline()
    assert (again.block_size, again.use_kv_cache, again.sampler) == (2, True, pipe.sampler)
    np.testing.assert_array_equal(again.sample_ids(np.zeros((128, 0), np.int32), key), tokens)


def test_export_samples_and_round_trips(trained, tmp_path):
    obj, params, _ = trained
    tokenizer = _Digits()
    pipe = MaskedDiffusionObjective(
        model=MODEL,
        mask_id=MASK,
        seq_len=L,
        tokenizer=tokenizer,
        sampler=MaskedSampler(num_steps=L),
    ).export({"params": {"policy": params}})
    assert isinstance(pipe, TokenDiffusionGeneration) and pipe.length == L
    key = jax.random.key(5)
    ids = pipe.sample_ids(PATTERNS[:2, :3], key)
    np.testing.assert_array_equal(ids[:, :3], PATTERNS[:2, :3])  # the prompt is kept
    assert (ids < V).all()  # nothing left masked
    text = pipe("".join(map(str, PATTERNS[0, :3])), key=key)
    assert len(text) == L and text.startswith("".join(map(str, PATTERNS[0, :3])))
    dataclasses.replace(pipe, tokenizer=ByteTokenizer()).save(tmp_path / "mdlm")
    again = TokenDiffusionGeneration.load(tmp_path / "mdlm", tokenizer=tokenizer)
    np.testing.assert_array_equal(again.sample_ids(PATTERNS[:2, :3], key), ids)
    assert (again.mask_id, again.length, again.block_size) == (MASK, L, None)
    # Pretrained.load recognises it; its save writes it back as it came
    loaded = Pretrained.load(tmp_path / "mdlm")
    loaded.save(tmp_path / "copy")
    for path in (tmp_path / "mdlm", tmp_path / "copy"):
        pipe = Pretrained.load(path).pipeline(tokenizer=tokenizer)
        assert isinstance(pipe, TokenDiffusionGeneration)
        np.testing.assert_array_equal(pipe.sample_ids(PATTERNS[:2, :3], key), ids)
    with pytest.raises(ValueError, match=r"saved in Dew's format .* not 'llama'"):
        loaded.save(tmp_path / "hf", format="llama")


class _Digits:
    """A tokenizer of the toy ids: '0'..'5'."""

    vocab_size = V
    end_id = None

    def encode(self, text):
        return [int(c) for c in text]

    def decode(self, ids):
        return "".join(str(i) for i in ids)


def test_bad_input_is_refused_before_compiling(params):
    with pytest.raises(ValueError, match=r"holds the mask id 6 as data \(row 1, 1 rows"):
        bad = PATTERNS.copy()
        bad[1, 2] = MASK
        objective().check_batch({"text": bad})
    with pytest.raises(ValueError, match=r"has no mask id .*mask_token='\[MASK\]'"):
        MaskedDiffusionObjective(model=MODEL, tokenizer=_Digits())
    with pytest.raises(ValueError, match=r"mask_id 258 is outside the model's vocabulary"):
        MaskedDiffusionObjective(model=MODEL, tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match=r"num_steps=0 must be a whole number >= 1"):
        MaskedSampler(num_steps=0)
    pipe = objective().export(
        {"params": {"policy": params}}, sampler=MaskedSampler(num_steps=3, first_hitting=True)
    )
    with pytest.raises(ValueError, match=r"num_steps=3 cannot unmask 8 masked tokens"):
        pipe.sample_ids(np.zeros((1, 0), np.int32), jax.random.key(0))
    with pytest.raises(ValueError, match=r"the prompt has 9 tokens but the sample is 8"):
        objective().export({"params": {"policy": params}}).sample_ids(
            np.zeros((1, 9), np.int32), jax.random.key(0)
        )
    for bad in (0, -1, 2.0, True):  # evaluation draws: a whole number >= 1
        with pytest.raises(ValueError, match=rf"eval_times={bad!r} must be a whole number >= 1"):
            objective(eval_times=bad)
    assert objective(eval_times=np.int64(4)).eval_times == 4
    with pytest.raises(ValueError, match=r"rows of 9 ids need 9 positions, more than"):
        MaskedDiffusionObjective(model=MODEL, mask_id=MASK).check_batch(
            {"text": np.zeros((2, 9), np.int32)}
        )
