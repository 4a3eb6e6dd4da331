"""DistillationObjective against numpy float64: the divergence at several beta and
temperatures (exact endpoints, continuity next to them, the forward-KL gradient in
closed form), the objective's loss with prompt and padding tokens, chunked ==
unchunked, accumulation on unequal weights, 8 devices == 1, the compiled step's
memory chunked vs unchunked, bfloat16 models (a float32, non-negative loss),
sequence-level KD's completions (the teacher's own decode), and bad input refused
before compiling (another vocabulary of the same size included)."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.objectives import Step
from dew.objectives.language.distillation import (
    DistillationObjective,
    distillation_losses,
    divergence,
)

V = 32
STUDENT = CausalTransformer(
    vocab_size=V, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16
)
# another size and shape: wider, deeper, tied embeddings
TEACHER = CausalTransformer(
    vocab_size=V,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    mlp_features=64,
    max_seq_len=16,
    tie_embeddings=True,
)
STEP = Step(index=jnp.int32(0), key=jax.random.key(0))


# ------------------------------------------------------------ numpy float64
def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_divergence(zs, zt, beta, temperature):
    s, t = log_softmax(zs / temperature), log_softmax(zt / temperature)
    ps, pt = np.exp(s), np.exp(t)
    if beta == 0:
        return (pt * (t - s)).sum(-1)
    if beta == 1:
        return (ps * (s - t)).sum(-1)
    m = np.log(beta * pt + (1 - beta) * ps)
    jsd = beta * (pt * (t - m)).sum(-1) + (1 - beta) * (ps * (s - m)).sum(-1)
    return jsd / (beta * (1 - beta))


def logits(seed, shape=(3, 5, V), scale=3.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale).astype(np.float32)


ZS, ZT = logits(0), logits(1)
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


@jax.jit
def _log_softmax(z, t):
    return jax.nn.log_softmax(z / t, axis=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_divergence_matches_numpy_at_several_beta_and_temperatures(temperature):
    s, t = _log_softmax(ZS, temperature), _log_softmax(ZT, temperature)
    for beta in BETAS:
        got = divergence(s, t, beta=beta)
        want = np_divergence(ZS, ZT, beta, temperature)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"beta={beta}")
        assert np.all(np.asarray(got) >= -1e-6)


def test_endpoints_are_the_kls_and_beta_is_continuous_next_to_them():
    s, t = _log_softmax(ZS, 1.0), _log_softmax(ZT, 1.0)
    forward, reverse = divergence(s, t, beta=0.0), divergence(s, t, beta=1.0)
    np.testing.assert_allclose(forward, np_divergence(ZS, ZT, 0, 1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(reverse, np_divergence(ZS, ZT, 1, 1), rtol=1e-6, atol=1e-6)
    # next to the ends, on sharp logits: the float64 formula (no cancellation of
    # log M - log p at beta 1e-6; the gap to the KL there is beta * chi^2, real)
    for beta in (1e-6, 1 - 1e-6):
        near = divergence(s, t, beta=beta)
        np.testing.assert_allclose(near, np_divergence(ZS, ZT, beta, 1), rtol=1e-5, atol=1e-5)
    # on logits of unit scale: within 1e-4 of the KLs (measured 1.6e-5 and 3.9e-6)
    zs, zt = logits(0, scale=1.0), logits(1, scale=1.0)
    s, t = _log_softmax(zs, 1.0), _log_softmax(zt, 1.0)
    for beta, end in ((1e-6, 0.0), (1 - 1e-6, 1.0)):
        near, at_end = divergence(s, t, beta=beta), divergence(s, t, beta=end)
        np.testing.assert_allclose(near, at_end, rtol=0, atol=1e-4, err_msg=str(beta))
        assert float(jnp.min(at_end)) > 0.05  # not TRL's unnormalised JSD, ~0 there


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_forward_kl_gradient_is_the_closed_form(temperature):
    """d/dz_S [T^2 KL(p_T || p_S)] = T (p_S - p_T) (Hinton et al. 2015, eq. 2)."""
    t = _log_softmax(ZT, temperature)

    def loss(z):
        return temperature**2 * jnp.sum(divergence(_log_softmax(z, temperature), t, beta=0.0))

    grad = jax.grad(loss)(jnp.asarray(ZS))
    ps, pt = np.exp(log_softmax(ZS / temperature)), np.exp(log_softmax(ZT / temperature))
    np.testing.assert_allclose(grad, temperature * (ps - pt), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------- the objective
@pytest.fixture(scope="module")
def weights():
    ids = jnp.zeros((1, 8), jnp.int32)
    student = nn.unbox(jax.jit(STUDENT.init)(jax.random.key(1), ids))["params"]
    teacher = nn.unbox(jax.jit(TEACHER.init)(jax.random.key(2), ids))["params"]
    # a sharper teacher than its near-uniform init
    teacher = jax.tree.map(lambda x: x * 3.0, teacher)
    return jax.device_get(student), jax.device_get(teacher)


ROWS, P, N = 8, 3, 5
RNG = np.random.default_rng(3)
PROMPT = RNG.integers(1, V, (ROWS, P)).astype(np.int32)
PROMPT_MASK = np.ones((ROWS, P), bool)
PROMPT_MASK[::2, 0] = False  # left padding
PROMPT[~PROMPT_MASK] = 0
COMPLETION = RNG.integers(1, V, (ROWS, N)).astype(np.int32)
LENGTHS = np.array([5, 1, 3, 5, 2, 4, 1, 5])  # unequal weights per row
COMPLETION_MASK = np.arange(N)[None] < LENGTHS[:, None]
COMPLETION[~COMPLETION_MASK] = 0
BATCH = dict(
    prompt=PROMPT, prompt_mask=PROMPT_MASK, completion=COMPLETION, completion_mask=COMPLETION_MASK
)


def make(weights, **kw):
    return DistillationObjective(student=STUDENT, teacher=TEACHER, teacher_params=weights[1], **kw)


def variables(weights):
    return {"params": {"policy": weights[0]}, "teacher": {"params": weights[1]}}


@jax.jit
def full_logits(weights, batch):
    """Each model's own full logits at the scored positions (what the loss must use)."""
    from dew.objectives.cores.logprobs import rollout_positions

    tokens = jnp.concatenate([batch["prompt"], batch["completion"]], 1)
    positions, mask = rollout_positions(jnp.asarray(batch["prompt_mask"]), N)
    extra = dict(positions=positions, attention_mask=mask)
    zs = STUDENT.apply({"params": weights[0]}, tokens, **extra)[:, P - 1 : P - 1 + N]
    zt = TEACHER.apply({"params": weights[1]}, tokens, **extra)[:, P - 1 : P - 1 + N]
    return zs, zt


def numpy_loss(weights, batch, *, beta, temperature, alpha):
    """The loss from each model's own full logits, in float64."""
    zs, zt = (np.asarray(z) for z in full_logits(weights, batch))
    d = np_divergence(zs, zt, beta, temperature)
    nll = -np.take_along_axis(log_softmax(zs), batch["completion"][..., None], -1)[..., 0]
    per_token = (1 - alpha) * temperature**2 * d + alpha * nll
    w = batch["completion_mask"].astype(np.float64)
    return (per_token * w).sum() / w.sum(), (d * w).sum() / w.sum()


@pytest.fixture(scope="module")
def default(weights):
    """One objective (beta 0.5, chunks of 2) and its compiled loss, shared."""
    objective = make(weights, beta=0.5, chunk_size=2)
    return objective, jax.jit(objective.loss)


@pytest.mark.parametrize(
    "beta,temperature,alpha,chunks",
    [(0.5, 1.0, 0.0, (2,)), (0.0, 2.0, 0.3, (2, None)), (1.0, 0.7, 0.0, (3,))],
)
def test_loss_matches_numpy_with_prompt_and_padding_chunked_or_not(
    weights, default, beta, temperature, alpha, chunks
):
    want, want_div = numpy_loss(weights, BATCH, beta=beta, temperature=temperature, alpha=alpha)
    for chunk in chunks:  # 5 positions in chunks of 2 or 3: the last one padded
        if (beta, temperature, alpha, chunk) == (0.5, 1.0, 0.0, 2):
            loss_fn = default[1]
        else:
            kw = dict(beta=beta, temperature=temperature, alpha=alpha, chunk_size=chunk)
            loss_fn = jax.jit(make(weights, **kw).loss)
        loss, metrics = loss_fn(variables(weights), BATCH, STEP)
        assert float(loss.weight) == LENGTHS.sum() == float(metrics["tokens"].total)
        np.testing.assert_allclose(loss.value, want, rtol=1e-5, err_msg=f"chunk {chunk}")
        np.testing.assert_allclose(metrics["divergence"].value, want_div, rtol=1e-5)


def test_padding_tokens_do_not_count(weights, default):
    """Other ids on masked completion positions and on left padding: the same loss."""
    other = dict(BATCH)
    other["completion"] = np.where(COMPLETION_MASK, COMPLETION, 7).astype(np.int32)
    other["prompt"] = np.where(PROMPT_MASK, PROMPT, 9).astype(np.int32)
    loss = default[1]
    a, b = loss(variables(weights), BATCH, STEP)[0], loss(variables(weights), other, STEP)[0]
    np.testing.assert_allclose(a.value, b.value, rtol=1e-6)


def test_text_rows_with_a_loss_mask_match_numpy(weights):
    """An LM/SFT reader's rows: the targets where the mask is 1 are scored."""
    text = np.concatenate([PROMPT[1::2], COMPLETION[1::2]], 1)  # unpadded prompts
    loss_mask = np.concatenate([np.zeros((4, P), bool), COMPLETION_MASK[1::2]], 1)
    objective = make(weights, text_key="text", loss_mask_key="loss_mask", beta=0.3, chunk_size=3)
    got, _ = jax.jit(objective.loss)(variables(weights), dict(text=text, loss_mask=loss_mask), STEP)
    sub = {k: v[1::2] for k, v in BATCH.items()}
    want, _ = numpy_loss(weights, sub, beta=0.3, temperature=1.0, alpha=0.0)
    np.testing.assert_allclose(got.value, want, rtol=1e-5)


@pytest.fixture(scope="module")
def grad_of_total(weights, default):
    """``(d total / d params, (total, weight))`` of the shared objective, compiled once."""
    objective = default[0]

    def fn(params, teacher, batch):
        loss, _ = objective.loss(
            {"params": {"policy": params}, "teacher": {"params": teacher}}, batch, STEP
        )
        return loss.total, (loss.total, loss.weight)

    return jax.jit(jax.grad(fn, has_aux=True))


def test_fused_chunk_gradients_equal_autodiff_of_the_full_logits(weights, grad_of_total):
    """The gradient computed chunk by chunk in the forward pass (chunked_sums) against
    plain autodiff of the divergence of both models' full logits."""
    from dew.objectives.language.distillation import distillation_losses

    def plain(params):
        zs, zt = full_logits((params, weights[1]), BATCH)
        terms = distillation_losses(zs, zt, BATCH["completion"], beta=0.5, temperature=1.0)
        return jnp.sum(terms["divergence"] * BATCH["completion_mask"])

    want = jax.jit(jax.grad(plain))(weights[0])
    got, _ = grad_of_total(*weights, BATCH)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max()),
        got,
        want,
    )


def test_accumulation_over_unequal_microbatches_equals_one_batch(weights, grad_of_total):
    """Rows 0-3 (14 tokens) and 4-7 (12 tokens): the sum of the microbatches' totals
    over the sum of their weights is the full batch's mean, values and gradients."""
    full, (total, weight) = grad_of_total(*weights, BATCH)
    parts = [
        grad_of_total(*weights, {k: v[s] for k, v in BATCH.items()})
        for s in (slice(0, 4), slice(4, 8))
    ]
    assert [float(w) for _, (_, w) in parts] == [14.0, 12.0] and float(weight) == 26.0
    tokens = sum(float(w) for _, (_, w) in parts)
    np.testing.assert_allclose(
        sum(float(t) for _, (t, _) in parts) / tokens, total / weight, rtol=1e-6
    )
    micro = jax.tree.map(lambda a, b: (a + b) / tokens, parts[0][0], parts[1][0])
    # float32 sums in another order (two halves, then added): 1e-5 of each array's scale
    # (an AMD EPYC put one entry of -0.0017 1.2e-7 off, in an array reaching 0.03)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            a, b / weight, rtol=1e-5, atol=1e-5 * np.abs(b / weight).max()
        ),
        micro,
        full,
    )


def test_eight_devices_equal_one(weights, grad_of_total):
    """Rows split over 8 devices (one each), parameters replicated."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    batch = {
        k: jax.device_put(v, NamedSharding(mesh, PartitionSpec("data"))) for k, v in BATCH.items()
    }
    replicated = jax.device_put(weights, NamedSharding(mesh, PartitionSpec()))
    assert len(batch["prompt"].sharding.device_set) == 8
    one, (total, _) = grad_of_total(*weights, BATCH)
    eight, (total8, _) = grad_of_total(*replicated, batch)
    np.testing.assert_allclose(total8, total, rtol=1e-6)
    # float32 sums in another order across devices: 1e-5 of each array's scale
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max()),
        eight,
        one,
    )


def test_chunked_step_does_not_hold_full_float32_logits():
    """The compiled gradient step's temporaries, chunked vs not, at vocabulary 8192:
    the unchunked one holds several [rows, length, vocab] float32 arrays."""
    big_v = 8192
    student = CausalTransformer(
        vocab_size=big_v,
        emb_features=16,
        num_layers=1,
        num_heads=2,
        mlp_features=32,
        max_seq_len=64,
    )
    teacher = student.clone(emb_features=32, num_heads=4)
    ids = jnp.zeros((1, 8), jnp.int32)
    ps = jax.eval_shape(lambda: nn.unbox(student.init(jax.random.key(0), ids))["params"])
    pt = jax.eval_shape(lambda: nn.unbox(teacher.init(jax.random.key(0), ids))["params"])
    rows, length = 4, 64
    batch = dict(text=jax.ShapeDtypeStruct((rows, length + 1), jnp.int32))
    sizes = {}
    for chunk in (8, None):
        objective = DistillationObjective(
            student=student, teacher=teacher, teacher_params=pt, text_key="text", chunk_size=chunk
        )

        def step(p, t, b, objective=objective):
            fn = lambda q: (
                objective.loss({"params": {"policy": q}, "teacher": {"params": t}}, b, STEP)[
                    0
                ].value
            )  # noqa: E731
            return jax.grad(fn)(p)

        compiled = jax.jit(step).lower(ps, pt, batch).compile()
        sizes[chunk] = compiled.memory_analysis().temp_size_in_bytes
    full = rows * length * big_v * 4  # one [rows, length, vocab] float32 array
    # unchunked: several full copies; chunks of 8 positions: under one
    assert sizes[None] >= 3 * full, sizes
    assert sizes[8] < full and 5 * sizes[8] < sizes[None], sizes


# -------------------------------------------------------------- bfloat16
@pytest.mark.slow  # ~5 s: a bfloat16 loss compiled
def test_bfloat16_models_give_a_float32_non_negative_loss(weights):
    """Student and teacher computing in bfloat16, the teacher the student's weights
    nudged (near-equal logits: where bf16 rounding could make a divergence negative,
    ms-swift #10156): at beta 0, 0.5 and 1 every token's divergence of the bfloat16
    logits is float32 and >= 0; so are the objective's loss and divergence (beta 0.5,
    T = 2, with prompt and padding)."""
    student = STUDENT.clone(dtype=jnp.bfloat16)
    near = jax.tree.map(
        lambda x: x + 0.01 * jax.random.normal(jax.random.key(5), x.shape), weights[0]
    )
    objective = DistillationObjective(
        student=student,
        teacher=student,
        teacher_params=near,
        beta=0.5,
        temperature=2.0,
        chunk_size=2,
    )
    both = {"params": {"policy": weights[0]}, "teacher": {"params": near}}
    loss, metrics = jax.jit(objective.loss)(both, BATCH, STEP)
    assert loss.value.dtype == metrics["divergence"].value.dtype == jnp.float32
    assert float(loss.value) >= 0 and float(metrics["divergence"].value) >= 0
    tokens = np.concatenate([PROMPT, COMPLETION], 1)
    zs, zt = (  # [rows, length, vocab] logits computed in bfloat16
        jax.jit(student.apply)({"params": p}, tokens).astype(jnp.bfloat16)
        for p in (weights[0], near)
    )
    for beta in (0.0, 0.5, 1.0):
        d = distillation_losses(zs, zt, beta=beta, temperature=2.0)["divergence"]
        assert d.dtype == jnp.float32
        assert float(d.min()) >= 0, (beta, float(d.min()))
        assert 0 < float(d.max()) < 1, beta  # near, not equal


# ------------------------------------------------------- sequence-level KD
@pytest.mark.slow  # ~5 s: the teacher's decode compiled twice (prepare, generate)
def test_seq_kd_completions_are_the_teachers_own_decode_at_the_step_key(weights):
    """With ``seq_kd`` (and ``lmbda`` 0) prepare's completions are the teacher's samples:
    what ``dew.sampling.generate`` draws with the teacher and its weights at the prepare
    key (``split(step.key)[1]``), each row up to its end id, then ``pad_id``; the data's
    completion tokens and mask are not read (other ones give the same batch)."""
    from dew.sampling import generate

    end_ids, pad = tuple(range(1, 9)), 0  # a quarter of the ids end a row
    objective = make(weights, seq_kd=True, end_ids=end_ids, pad_id=pad)
    assert objective.has_prepare
    prepare = jax.jit(objective.prepare)
    out = jax.device_get(prepare(variables(weights), BATCH, STEP))
    other_data = dict(BATCH, completion=(COMPLETION + 11) % V, completion_mask=~COMPLETION_MASK)
    again = jax.device_get(prepare(variables(weights), other_data, STEP))
    for k in ("prompt", "prompt_mask", "completion", "completion_mask", "on_policy"):
        np.testing.assert_array_equal(again[k], out[k], err_msg=k)

    prompts = [row[mask].tolist() for row, mask in zip(PROMPT, PROMPT_MASK)]
    key = jax.random.split(STEP.key)[1]
    want = generate(
        TEACHER, weights[1], prompts, N, key, sampling=objective.sampling, end_ids=end_ids
    )
    lengths = out["completion_mask"].sum(1)
    assert lengths.tolist() == want.lengths and 0 < lengths.min() < N == lengths.max()
    for r, prompt in enumerate(prompts):
        new = want.tokens[r][len(prompt) :]
        assert out["completion"][r].tolist() == new + [pad] * (N - len(new)), r
    assert not np.any(out["on_policy"])
    # not the data's: the teacher's samples differ from the completions read in
    assert not np.array_equal(out["completion"], COMPLETION)


@pytest.mark.slow  # ~5 s: the student's decode compiled twice (prepare, generate)
def test_on_policy_completions_are_the_students_decode_with_its_current_weights(weights):
    """With ``lmbda`` 1 prepare's completions are what ``dew.sampling.generate`` draws
    with the student and the weights prepare is given (the current ones, not the
    initial: moved weights give their own decode) at the prepare key, each row up to
    its end id, then ``pad_id``; the data's completions are not read."""
    from dew.sampling import generate

    end_ids, pad = tuple(range(1, 9)), 0
    objective = make(weights, lmbda=1.0, end_ids=end_ids, pad_id=pad)
    prepare = jax.jit(objective.prepare)
    prompts = [row[mask].tolist() for row, mask in zip(PROMPT, PROMPT_MASK)]
    key = jax.random.split(STEP.key)[1]
    moved = jax.tree.map(
        lambda x: x + 0.5 * jax.random.normal(jax.random.key(6), x.shape), weights[0]
    )
    outs = []
    for params in (weights[0], moved):
        both = {"params": {"policy": params}, "teacher": {"params": weights[1]}}
        out = jax.device_get(prepare(both, BATCH, STEP))
        want = generate(
            STUDENT, params, prompts, N, key, sampling=objective.sampling, end_ids=end_ids
        )
        assert out["completion_mask"].sum(1).tolist() == want.lengths
        for r, prompt in enumerate(prompts):
            new = want.tokens[r][len(prompt) :]
            assert out["completion"][r].tolist() == new + [pad] * (N - len(new)), r
        assert np.all(out["on_policy"] == 1)
        outs.append(out["completion"])
    assert not np.array_equal(outs[0], outs[1])  # the weights prepare is given decide


# ------------------------------------------------------------- bad input
def test_bad_input_is_refused_before_compiling(weights):
    other_vocab = TEACHER.clone(vocab_size=V + 8)
    with pytest.raises(ValueError, match=r"teacher's vocabulary \(40 ids\).*student's \(32\)"):
        DistillationObjective(student=STUDENT, teacher=other_vocab, teacher_params=weights[1])
    # a mapping makes it allowed (and is checked)
    DistillationObjective(
        student=STUDENT, teacher=other_vocab, teacher_params=weights[1], teacher_ids=np.arange(V)
    )
    with pytest.raises(ValueError, match="outside the teacher's vocabulary of 40"):
        DistillationObjective(
            student=STUDENT,
            teacher=other_vocab,
            teacher_params=weights[1],
            teacher_ids=np.arange(V) + 9,
        )
    for bad in dict(beta=-0.1), dict(beta=1.5), dict(beta=float("nan")):
        with pytest.raises(ValueError, match=r"beta=.* must be a finite number in \[0, 1\]"):
            make(weights, **bad)
    for t in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"temperature=.* must be a finite number > 0"):
            make(weights, temperature=t)
    # numbers in every numeric form (issue 42); bools are not numbers
    for form in (np.float32, np.float64, np.array):
        objective = make(weights, temperature=form(2.0), beta=form(0.5), lmbda=form(0.25))
        assert (objective.temperature, objective.beta, objective.lmbda) == (2.0, 0.5, 0.25)
        assert type(objective.temperature) is float
    assert make(weights, temperature=np.int64(2)).temperature == 2.0
    with pytest.raises(ValueError, match=r"temperature=True must be a finite number > 0"):
        make(weights, temperature=True)
    with pytest.raises(ValueError, match=r"beta=np.float32\(nan\) must be a finite number in"):
        make(weights, beta=np.float32("nan"))
    for lmbda in (-0.5, 1.01):
        with pytest.raises(ValueError, match=r"lmbda=.* must be a finite number in \[0, 1\]"):
            make(weights, lmbda=lmbda)
    with pytest.raises(ValueError, match="alpha"):
        make(weights, alpha=2.0)
    with pytest.raises(ValueError, match="needs the teacher's weights"):
        DistillationObjective(student=STUDENT, teacher=TEACHER)
    with pytest.raises(ValueError, match="no prompts to sample from"):
        make(weights, text_key="text", lmbda=0.5)


def word_tokenizer(directory, words, *, pretty=True):
    """An ``HFTokenizer`` (WordLevel) of ``<unk>``, ``<eos>`` and ``words``, saved in
    ``directory`` (``pretty``: the JSON indented)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from dew.data import HFTokenizer

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=pretty)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return HFTokenizer(directory)


def test_tokenizers_of_one_size_with_other_tokens_are_refused(weights, tmp_path):
    """Same-size vocabularies are compared by what their ids mean (the id -> token
    table): a teacher whose tokenizer holds other words, or the same words in another
    order, is refused naming both tokenizers and ``teacher_ids``; the same vocabulary
    read from another file passes, and so does any pair given a mapping."""
    pytest.importorskip("tokenizers")
    words = ["the", "cat", "sat", "on", "a", "mat"]
    student = word_tokenizer(tmp_path / "student", words)
    same = word_tokenizer(tmp_path / "same", words, pretty=False)  # the same table
    assert student.fingerprint() != same.fingerprint()
    make(weights, tokenizer=student, teacher_tokenizer=same)
    make(weights, tokenizer=student)  # the teacher's tokenizer not known: sizes only
    for name, other in (
        ("other", ["the", "dog", "ran", "in", "a", "park"]),
        ("reordered", words[::-1]),
    ):
        teacher = word_tokenizer(tmp_path / name, other)
        assert teacher.vocab_size == student.vocab_size == 8
        message = (
            rf"the teacher's tokenizer HFTokenizer\(.*{name}.tokenizer.json\) and the "
            rf"student's HFTokenizer\(.*student.tokenizer.json\) are different vocabularies "
            rf"of the same size \(32 ids.*pass teacher_ids="
        )
        with pytest.raises(ValueError, match=message):
            make(weights, tokenizer=student, teacher_tokenizer=teacher)
        # a Pretrained teacher brings its own tokenizer
        pretrained = types.SimpleNamespace(model=TEACHER, params=weights[1], tokenizer=teacher)
        with pytest.raises(ValueError, match=message):
            DistillationObjective(student=STUDENT, teacher=pretrained, tokenizer=student)
        order = {w: i for i, w in enumerate(["<unk>", "<eos>", *other])}
        mapping = np.asarray(
            [order.get(w, 0) for w in ["<unk>", "<eos>", *words]] + list(range(8, V))
        )
        make(weights, tokenizer=student, teacher_tokenizer=teacher, teacher_ids=mapping)
