"""Knowledge distillation of a causal LM (or any logits model) from a frozen teacher.

Per scored token, with the student's logits ``z_S`` and the teacher's ``z_T`` at
temperature ``T`` (both divided by it), ``p_S = softmax(z_S / T)`` and
``p_T = softmax(z_T / T)``, the divergence is the generalized Jensen-Shannon
divergence of GKD (Agarwal et al. 2024, arXiv 2306.13649, eq. 4; TRL's
``generalized_jsd_loss`` mixture, ``M = beta p_T + (1 - beta) p_S``) divided by
``beta (1 - beta)``:

    D_beta = [beta KL(p_T || M) + (1 - beta) KL(p_S || M)] / (beta (1 - beta))
    D_0    = KL(p_T || p_S)          forward KL (Hinton et al. 2015, supervised KD)
    D_1    = KL(p_S || p_T)          reverse KL (MiniLLM; on-policy "OPD")

The division makes ``D`` continuous on ``[0, 1]`` with the KLs at the ends
(``JSD_beta ~ beta KL(p_T || p_S)`` as ``beta -> 0``); TRL's JSD at
``beta = 0.5`` is ``D / 4``. The endpoints are computed as the KLs themselves
(exact), the interior in log space from the log-ratio ``d = log p_T - log p_S``:
``log M - log p_S = logaddexp(log(1 - beta), log(beta) + d)``, so a ``beta`` of
1e-6 is not lost in ``log M - log p_S`` rounding (trl #2202, PR #3043;
ms-swift #10078; verl-recipe #151 are the bugs this avoids).

The loss per token is ``(1 - alpha) T^2 D_beta + alpha CE(z_S, y)`` (the hard-label
cross-entropy at temperature 1; Hinton's ``T^2`` keeps gradients the same size
across ``T``), a :class:`~dew.objectives.Weighted` mean over the scored tokens
(prompt and padding never counted), so accumulation and devices divide once by
the global token count (trl #4719). Everything is float32 whatever the models'
dtype, and it is computed over chunks of ``chunk_size`` positions
(:func:`chunked_sums`: a ``lax.scan`` that computes each chunk's loss and its
gradient in the forward pass, so nothing is recomputed): from the final hidden
states for :class:`dew.nn.CausalTransformer` (the output projections run per
chunk), so the step never holds ``[batch, length, vocab]`` float32 logits of
either model.

Sequences (``lmbda``, ``seq_kd``): with probability ``lmbda`` a batch's
completions are sampled from the student with its current weights in the
compiled prepare phase (on-policy, GKD); otherwise they are the data's, or,
with ``seq_kd``, samples of the teacher (sequence-level KD, Kim and Rush 2016).

:func:`divergence` and :func:`distillation_losses` work on any logits (a
classifier's: Hinton soft targets with the same losses).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.nn.dense import token_rows
from dew.nn.keywords import real_number
from dew.objectives.contract import registry
from dew.objectives.contract.batch import FLOATS, IDS, MASK, BatchField
from dew.objectives.contract.objective import Objective, Role, Step, with_initial_values
from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.logprobs import rollout_positions
from dew.objectives.cores.policy import CausalPolicy, check_same_vocabulary, vocab_size_of
from dew.objectives.cores.rollouts import prompt_fields, sample_completions
from dew.objectives.language.lm import check_packed_positions, packed_inputs, target_weights
from dew.sampling import Sampling

__all__ = [
    "DistillationObjective",
    "chunked_sums",
    "distillation_losses",
    "divergence",
    "topk_divergence",
]


# ------------------------------------------------------------------ the losses
def _sum_p_times(logp: jax.Array, x: jax.Array) -> jax.Array:
    """``sum_v p_v x_v`` over the last axis, 0 where ``p`` is 0 (a top-k teacher)."""
    p = jnp.exp(logp)
    return jnp.sum(jnp.where(p > 0, p * x, 0.0), axis=-1)


def divergence(student_logps: jax.Array, teacher_logps: jax.Array, *, beta: float) -> jax.Array:
    """``D_beta(p_T, p_S)`` (module docstring) over the last axis, float32.

    student_logps, teacher_logps: ``[..., vocab]`` normalized log-probs (a
      ``log_softmax``), at the temperature of the loss.
    beta: in ``[0, 1]``; 0 = ``KL(p_T || p_S)``, 1 = ``KL(p_S || p_T)``, both exact.
    Returns ``[...]``.
    """
    check_beta(beta)
    s = student_logps.astype(jnp.float32)
    t = teacher_logps.astype(jnp.float32)
    if beta == 0.0:
        return _sum_p_times(t, t - s)
    if beta == 1.0:
        return _sum_p_times(s, s - t)
    log_b, log_1mb = math.log(beta), math.log1p(-beta)  # float64, then float32 constants
    d = t - s  # [..., vocab] log p_T - log p_S
    # One logaddexp, the other difference from it: the one computed directly is the one
    # the small weight divides (KL(p_S || M) / beta for beta < 1/2), so its rounding
    # stays relative to it; the derived one is divided by at most 2.
    if beta < 0.5:
        m_minus_s = jnp.logaddexp(log_1mb, log_b + d)  # log M - log p_S
        m_minus_t = m_minus_s - d  # log M - log p_T
    else:
        m_minus_t = jnp.logaddexp(log_1mb - d, log_b)
        m_minus_s = m_minus_t + d
    kl_teacher = -_sum_p_times(t, m_minus_t)  # KL(p_T || M)
    kl_student = -_sum_p_times(s, m_minus_s)  # KL(p_S || M)
    return kl_teacher / (1.0 - beta) + kl_student / beta


def distillation_losses(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array | None = None,
    *,
    beta: float,
    temperature: float,
) -> dict[str, jax.Array]:
    """Per-token (or per-example) terms of the distillation loss, float32 ``[...]``.

    student_logits, teacher_logits: ``[..., vocab]`` (any dtype; cast to float32).
    targets: ``[...]`` hard labels (the next tokens, a class), or None.
    Returns ``divergence`` (``D_beta`` at ``temperature``, without ``T^2``) and,
    with targets, ``nll`` (the student's cross-entropy at temperature 1),
    ``teacher_nll`` and ``agreement`` (1 where both models' argmax agree).
    """
    check_temperature(temperature)
    zs = student_logits.astype(jnp.float32)
    zt = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32))
    s = jax.nn.log_softmax(zs / temperature, axis=-1)
    t = jax.nn.log_softmax(zt / temperature, axis=-1)
    out = {"divergence": divergence(s, t, beta=beta), "agreement": agreement(zs, zt)}
    if targets is not None:
        ids = targets[..., None].astype(jnp.int32)

        def nll(z, logp):  # at temperature 1: logsumexp(z) - z[y], one pass when T != 1
            if temperature == 1.0:
                return -jnp.take_along_axis(logp, ids, axis=-1)[..., 0]
            return jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, ids, axis=-1)[..., 0]

        out["nll"], out["teacher_nll"] = nll(zs, s), nll(zt, t)
    return out


def agreement(student_logits: jax.Array, teacher_logits: jax.Array) -> jax.Array:
    """1.0 where both models' most likely id is the same, float32 ``[...]``: some id is
    a maximum of both (two max reductions and one compare; ``jnp.argmax``, a variadic
    reduce, took 8x the time on the CPU at vocabulary 4096, a fifth of a step). Ties,
    of measure zero for float logits, count as agreement when any tied id is shared."""
    top_s = student_logits == jnp.max(student_logits, axis=-1, keepdims=True)
    top_t = teacher_logits == jnp.max(teacher_logits, axis=-1, keepdims=True)
    return jnp.max(jnp.where(top_s & top_t, 1.0, 0.0), axis=-1)


# a masked logit: finite, so a tail of no ids is a finite log-mass far below any
# float32 probability (exp underflows to 0) and its gradient stays finite
_MASKED = -1e9


def _tail_logsumexp(z: jax.Array, ids: jax.Array) -> jax.Array:
    """``logsumexp`` over the last axis of ``z [..., vocab]`` without ``ids [..., k]``."""
    keep = jnp.ones(z.shape, bool)
    lead = jnp.indices(ids.shape, sparse=True)[:-1]
    keep = keep.at[(*lead, ids)].set(False)
    return jax.nn.logsumexp(jnp.where(keep, z, _MASKED), axis=-1)


def topk_divergence(
    student_logits: jax.Array,
    ids: jax.Array,
    logprobs: jax.Array,
    tail: jax.Array,
    *,
    beta: float,
    temperature: float,
) -> jax.Array:
    """``D_beta`` of the teacher's stored top-k and the student, on ``k + 1``
    categories (``dew.objectives.language.teacher_topk``), float32 ``[...]``.

    student_logits: ``[..., vocab]`` (any dtype; cast to float32), at temperature 1.
    ids, logprobs, tail: the teacher's ``[..., k]``, ``[..., k]`` and ``[...]``, at
      ``temperature`` (what :func:`teacher_topk` and ``dew.data.TeacherTopK`` give).
    """
    check_temperature(temperature)
    z = student_logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(z, axis=-1, keepdims=True)
    ids = ids.astype(jnp.int32)
    s_top = jnp.take_along_axis(z, ids, axis=-1) - logz
    s_tail = _tail_logsumexp(z, ids) - logz[..., 0]
    s = jnp.concatenate([s_top, s_tail[..., None]], axis=-1)  # [..., k + 1]
    t = jax.lax.stop_gradient(
        jnp.concatenate([logprobs, tail[..., None]], axis=-1).astype(jnp.float32)
    )
    return divergence(s, jnp.maximum(t, _MASKED), beta=beta)


# --------------------------------------------------------------------- checks
def check_beta(beta) -> float:
    """``beta`` as a float in ``[0, 1]`` (any numeric form), or a ValueError."""
    return real_number(
        beta,
        "beta",
        low=0.0,
        high=1.0,
        meaning=(
            "0 = forward KL(teacher || student), 1 = reverse KL(student || teacher), between "
            "them the generalized JSD"
        ),
    )


def check_temperature(temperature) -> float:
    """``temperature`` as a float > 0 (any numeric form), or a ValueError."""
    return real_number(
        temperature,
        "temperature",
        low=0.0,
        low_open=True,
        meaning=("both models' logits are divided by it; 1 = their own distributions"),
    )


def check_fraction(name: str, value, meaning: str) -> float:
    """``value`` as a float in ``[0, 1]`` (any numeric form), or a ValueError."""
    return real_number(value, name, low=0.0, high=1.0, meaning=meaning)


# -------------------------------------------------------------- output heads
def output_head(module, params):
    """``(kernel [embed, vocab], dtype)`` of a :class:`dew.nn.CausalTransformer`'s output
    projection (its ``lm_head``, or the tied embedding transposed), which maps the
    final hidden states to the logits as the module does; None for any other module
    (its full logits are used)."""
    from dew.nn import CausalTransformer
    from dew.nn.lora import lora_of

    if not isinstance(module, CausalTransformer) or lora_of(module) is not None:
        return None
    params = nn.meta.unbox(params)
    if module.tie_embeddings:
        kernel = params["embed"]["embedding"].T  # [embed, vocab]
    else:
        kernel = params["lm_head"]["kernel"]  # [embed, vocab]
    return kernel, module.dtype or kernel.dtype


def _project(hidden, kernel, dtype):
    """Logits float32 from hidden states and a head kernel; ``dtype`` None = the
    states are the logits already (a module without a known head)."""
    if dtype is None:
        return hidden.astype(jnp.float32)
    # one token axis, as the model's own head (dew.nn.dense.token_rows): a plain 2-d
    # matmul, and so is its kernel gradient, where a dot contracting [rows, chunk]
    # compiled to a slow loop on the CPU (tools/bench_distill.py: the step 1.5x slower)
    rows = token_rows(hidden).astype(dtype)  # [rows * chunk, embed]
    logits = jnp.dot(rows, kernel.astype(dtype)).astype(jnp.float32)  # [rows * chunk, vocab]
    return logits.reshape(*hidden.shape[:-1], -1)


def chunked_sums(sums_fn, chunk, hidden, kernel, teacher_hidden, teacher_kernel, targets, weights):
    """``(total, sums)`` of ``sums_fn`` over chunks of ``chunk`` positions (axis 1), with
    the gradient of ``total`` in ``hidden`` and ``kernel`` computed chunk by chunk in the
    forward pass (a ``lax.scan`` that accumulates the kernel's gradient; Liger's fused
    linear cross-entropy does the same): the step holds one chunk's
    ``[rows, chunk, vocab]`` logits of each model, and nothing is recomputed for the
    backward pass (which only scales the stored gradients).

    sums_fn: ``(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights) ->
      (total, {name: sum})`` on one chunk; only ``total`` is differentiated (the sums
      are metrics). The teacher's arguments get no gradient; ``teacher_hidden`` may be
      a tuple of arrays (stored top-k), each chunked along axis 1.
    chunk: positions per chunk; None = one chunk of the whole length.
    """
    length = hidden.shape[1]
    chunk = length if chunk is None else min(int(chunk), length)
    n = -(-length // chunk)
    pad = n * chunk - length

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(x.shape[0], n, chunk, *x.shape[2:]).swapaxes(0, 1)

    def run(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights):
        grad = jax.value_and_grad(sums_fn, argnums=(0, 1), has_aux=True)

        def body(carry, xs):
            total, sums, d_kernel = carry
            h, th, y, w = xs
            (t, s), (d_h, d_k) = grad(h, kernel, th, teacher_kernel, y, w)
            sums = jax.tree.map(jnp.add, sums, s)
            return (total + t, sums, d_kernel + d_k.astype(jnp.float32)), d_h

        xs = tuple(jax.tree.map(split, x) for x in (hidden, teacher_hidden, targets, weights))
        shapes = jax.eval_shape(
            sums_fn,
            hidden[:, :chunk],
            kernel,
            jax.tree.map(lambda x: x[:, :chunk], teacher_hidden),
            teacher_kernel,
            targets[:, :chunk],
            weights[:, :chunk],
        )[1]
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shapes)
        start = (jnp.zeros((), jnp.float32), zeros, jnp.zeros(kernel.shape, jnp.float32))
        (total, sums, d_kernel), d_hidden = jax.lax.scan(body, start, xs)
        d_hidden = d_hidden.swapaxes(0, 1).reshape(hidden.shape[0], n * chunk, *hidden.shape[2:])
        return (total, sums), (d_hidden[:, :length].astype(hidden.dtype), d_kernel)

    kernel_dtype = kernel.dtype

    @jax.custom_vjp
    def fused(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights):
        return run(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights)[0]

    def forward(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights):
        return run(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights)

    def backward(residuals, cotangents):
        d_hidden, d_kernel = residuals
        g = cotangents[0]  # d loss / d total; the sums are metrics
        no = jax.tree.map(lambda _: None, teacher_hidden)
        return (g * d_hidden, (g * d_kernel).astype(kernel_dtype), no, None, None, None)

    fused.defvjp(forward, backward)
    return fused(hidden, kernel, teacher_hidden, teacher_kernel, targets, weights)


# ------------------------------------------------------------------ objective
STORED_IDS, STORED_LOGPROBS, STORED_TAIL = (
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "teacher_tail_logprob",
)  # the batch keys of dew.data.TeacherTopK


class _StoredTeacher(nn.Module):
    """The teacher role of ``stored_teacher=True``: no weights (one empty array) and
    never run; its vocabulary is the student's, for the checks."""

    vocab_size: int | None = None

    @nn.compact
    def __call__(self, tokens, **_):
        self.param("none", nn.initializers.zeros, (0,), jnp.float32)
        return jnp.zeros((*tokens.shape, self.vocab_size or 1), jnp.float32)


@registry.register("distillation")
@dataclasses.dataclass(eq=False)
class DistillationObjective(Objective):
    """A causal-LM student distilled from a frozen teacher (module docstring for the math).

    student: the trained causal module (:class:`dew.nn.CausalTransformer`, or any
      ``apply(variables, ids, positions=, attention_mask=) -> [batch, length, vocab]``).
    teacher: the teacher's module, or a ``dew.sampling.Pretrained`` (module and
      weights: ``Pretrained.load`` of a Hugging Face directory or a Dew run's save);
      None = the student's architecture. Another size or family than the student
      is fine; its vocabulary must be the student's unless ``teacher_ids`` maps it.
    teacher_params: the teacher's weights (required unless ``teacher`` is a ``Pretrained``).
      A frozen role (``variables['teacher']``): checkpointed, never optimized.
    beta: the divergence, in ``[0, 1]``: 0 = forward KL, 1 = reverse KL, between them
      ``D_beta`` (the generalized JSD over ``beta (1 - beta)``).
    temperature: > 0; both models' logits are divided by it and the divergence
      multiplied by ``temperature**2``.
    alpha: in ``[0, 1]``; weight of the student's hard-label cross-entropy on the
      sequence's own tokens; the divergence gets ``1 - alpha``. 0 = pure distillation.
    lmbda: in ``[0, 1]``; the fraction of batches whose completions the student
      samples (on-policy, in the compiled prepare phase); 0 = never, 1 = always.
    seq_kd: the batches that are not on-policy use completions the teacher samples
      (sequence-level KD) instead of the data's.
    max_new_tokens: completion length of sampled sequences, in tokens; None = the
      data's completion width (``batch['completion']``).
    sampling: how the student (and, with ``seq_kd``, the teacher) samples.
    end_ids: ids that end a sampled completion (counted in it); () = none.
    pad_id: fills sampled completions after their end.
    chunk_size: positions per chunk of the loss; None = the whole sequence at once
      (holds ``[batch, length, vocab]`` float32 for both models).
    teacher_ids: int ``[student vocab]``: the teacher id of each student id, when the
      vocabularies differ (a teacher with a few extra rows: ``np.arange(student_vocab)``);
      the teacher's logits at these ids are its distribution, renormalised. None =
      the same vocabulary, required.
    text_key: read rows of ids (``batch[text_key] [rows, length + 1]``, an LM/SFT reader's)
      instead of prompts and completions; off-policy only (``lmbda=0``, no ``seq_kd``).
    loss_mask_key: with ``text_key``, a ``[rows, length + 1]`` 0/1 mask; a target counts
      where it is 1 (completion tokens only); None = every target.
    segment_ids_key, positions_key: with ``text_key``, the ``[rows, length + 1]`` segment
      ids and positions of packed rows (``dew.data.SFTExamples(packing=True)``), handed
      to both models as ``LMObjective`` hands them: no token attends across examples,
      positions restart per example, and a target in another example than the id that
      predicts it (or on padding) never counts. None = rows of one sequence.
    stored_teacher: read the teacher's top-k log-probs from the batches
      (``teacher_topk_ids``, ``teacher_topk_logprobs``, ``teacher_tail_logprob``, as
      :class:`dew.data.TeacherTopK` reads what
      :func:`dew.objectives.language.teacher_topk.write_teacher_topk` stored) instead of
      running a teacher; the divergence is then on the k ids and the tail
      (:func:`dew.objectives.language.teacher_topk.topk_divergence`). Needs ``text_key``, no
      teacher (``teacher`` and ``teacher_params`` None), and ``temperature`` the
      stored one (``TeacherTopK.temperature``).
    init_params: start the student from these weights; None = a fresh init.
    tokenizer: the student's, for previews and export; None = ``ByteTokenizer()``.
    teacher_tokenizer: the teacher's; None = a ``Pretrained`` teacher's own, else not
      known. When it and ``tokenizer`` are both given and no ``teacher_ids``, their
      vocabularies must be one (:func:`dew.objectives.cores.policy.check_same_vocabulary`
      compares what the ids mean, not only the sizes), else a ValueError before
      anything is compiled.

    Batches (without ``text_key``): left-padded ``prompt``/``prompt_mask`` (as
    ``dew.data.Prompts`` and GRPO read them) and right-padded ``completion`` /
    ``completion_mask`` (the data's sequences; not read when every batch is sampled).
    Metrics: ``divergence`` (``D_beta`` at the temperature, no ``T^2``), ``nll``,
    ``teacher_nll``, ``agreement`` (argmax of both agree), ``tokens``, and
    ``on_policy`` (the share of student-sampled batches) with a prepare phase.
    """

    student: Any
    teacher: Any = None
    teacher_params: Any = None
    beta: float = 0.5
    temperature: float = 1.0
    alpha: float = 0.0
    lmbda: float = 0.0
    seq_kd: bool = False
    max_new_tokens: int | None = None
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    end_ids: tuple[int, ...] = ()
    pad_id: int = 0
    chunk_size: int | None = 128
    teacher_ids: Any = None
    text_key: str | None = None
    loss_mask_key: str | None = None
    segment_ids_key: str | None = None
    positions_key: str | None = None
    stored_teacher: bool = False
    init_params: Any = None
    tokenizer: Any = None
    teacher_tokenizer: Any = None

    headline_metrics = ("divergence",)

    def __post_init__(self):
        what = type(self).__name__
        self.beta = check_beta(self.beta)
        self.temperature = check_temperature(self.temperature)
        self.alpha = check_fraction(
            "alpha", self.alpha, "the weight of the hard-label cross-entropy"
        )
        self.lmbda = check_fraction(
            "lmbda", self.lmbda, "the fraction of batches the student samples"
        )
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or int(self.chunk_size) < 1
        ):
            raise ValueError(f"chunk_size must be >= 1 positions or None, got {self.chunk_size!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 tokens, got {self.max_new_tokens}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {self.sampling!r}")
        if self.text_key is not None and self.samples:
            raise ValueError(
                f"{what}(text_key={self.text_key!r}) reads fixed rows of ids, which have no "
                f"prompts to sample from; lmbda={self.lmbda} and seq_kd={self.seq_kd} need "
                f"prompt/completion batches (drop text_key) or use lmbda=0, seq_kd=False"
            )
        packed = [k for k in (self.loss_mask_key, self.segment_ids_key, self.positions_key) if k]
        if packed and self.text_key is None:
            raise ValueError(
                f"{what}: loss_mask_key, segment_ids_key and positions_key ({packed}) name "
                f"columns of rows of ids; pass text_key= too (an SFT reader's 'text')"
            )
        if self.stored_teacher:
            if self.text_key is None or self.teacher is not None or self.teacher_params is not None:
                raise ValueError(
                    f"{what}(stored_teacher=True) reads the teacher's top-k from rows of ids "
                    f"(dew.data.TeacherTopK): pass text_key= (its 'text') and no teacher or "
                    f"teacher_params (got text_key={self.text_key!r}, teacher "
                    f"{type(self.teacher).__name__}, teacher_params "
                    f"{'given' if self.teacher_params is not None else 'None'})"
                )
            # a frozen role of no weights: the stored top-k stand for the teacher
            self.teacher = _StoredTeacher(vocab_size=vocab_size_of(self.student))
            self.teacher_params = {"none": np.zeros((0,), np.float32)}
        if hasattr(self.teacher, "params") and hasattr(self.teacher, "model"):  # a Pretrained
            if self.teacher_tokenizer is None:
                self.teacher_tokenizer = getattr(self.teacher, "tokenizer", None)
            if self.teacher_params is None:
                self.teacher_params = self.teacher.params
            self.teacher = self.teacher.model
        if self.teacher is None:
            self.teacher = self.student
        if self.teacher_params is None:
            raise ValueError(
                f"{what} needs the teacher's weights: pass teacher_params= (a trained run's "
                f"params) or teacher=Pretrained.load(directory)"
            )
        self.model = self.student
        self.end_ids = tuple(int(e) for e in self.end_ids)
        self._check_vocabularies(what)
        self.policy = CausalPolicy(
            model=self.student, what=what, tokenizer=self.tokenizer, init_params=self.init_params
        )
        self.tokenizer = self.policy.tokenizer

    def _check_vocabularies(self, what: str) -> None:
        student, teacher = vocab_size_of(self.student), vocab_size_of(self.teacher)
        if self.teacher_ids is None:
            check_same_vocabulary(
                self.student,
                self.teacher,
                what=what,
                names=("student", "teacher"),
                tokenizers=(self.tokenizer, self.teacher_tokenizer),
                fix=(
                    f"use a teacher with the student's tokenizer, or pass teacher_ids= (int "
                    f"[{student}]: the teacher id of each student id; np.arange({student}) when "
                    f"the student's ids are the teacher's first ones, a teacher with extra rows)"
                ),
            )
            return
        ids = np.asarray(self.teacher_ids)
        if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
            raise TypeError(f"teacher_ids must be a 1-d integer array, got {ids.dtype} {ids.shape}")
        if student is not None and ids.shape[0] != student:
            raise ValueError(
                f"{what}: teacher_ids has {ids.shape[0]} entries, the student's vocabulary "
                f"{student} ids; give the teacher id of every student id"
            )
        if ids.size and (ids.min() < 0 or (teacher is not None and ids.max() >= teacher)):
            raise ValueError(
                f"{what}: teacher_ids holds ids in [{ids.min()}, {ids.max()}], outside the "
                f"teacher's vocabulary of {teacher} ids"
            )
        self.teacher_ids = ids.astype(np.int32)

    @property
    def samples(self) -> bool:
        """Whether a prepare phase samples sequences (student or teacher)."""
        return self.lmbda > 0 or self.seq_kd

    @property
    def has_prepare(self) -> bool:
        return self.samples

    # ----------------------------------------------------------------- roles
    def roles(self):
        return (
            Role(name="policy", module=self.student),
            Role(name="teacher", module=self.teacher, trained=False),
        )

    def batch_fields(self):
        if self.text_key is not None:
            fields = [BatchField(self.text_key, ("length",), IDS)]
            if self.loss_mask_key is not None:
                fields.append(BatchField(self.loss_mask_key, ("length",), MASK))
            for key in (self.segment_ids_key, self.positions_key):
                if key is not None:
                    fields.append(BatchField(key, ("length",), IDS))
            if self.stored_teacher:
                fields += [
                    BatchField(STORED_IDS, ("positions", "k"), IDS, note="length - 1, k"),
                    BatchField(STORED_LOGPROBS, ("positions", "k"), FLOATS),
                    BatchField(STORED_TAIL, ("positions",), FLOATS),
                ]
            return tuple(fields)
        needs_data = self.lmbda < 1 and not self.seq_kd
        return (
            *prompt_fields(),
            BatchField("completion", ("completion_len",), IDS, required=needs_data),
            BatchField("completion_mask", ("completion_len",), MASK, required=needs_data),
        )

    def _length(self, spec) -> int:
        if spec is None:
            return int(getattr(self.student, "max_seq_len", None) or 8)
        if self.text_key is not None and self.text_key in spec:
            return int(tuple(spec[self.text_key].shape)[0]) - 1
        if "prompt" in spec:
            new = self.max_new_tokens
            if new is None and "completion" in spec:
                new = int(tuple(spec["completion"].shape)[0])
            return int(tuple(spec["prompt"].shape)[0]) + (new or 0)
        return int(getattr(self.student, "max_seq_len", None) or 8)

    init_reads_spec = True  # init(key, spec=...): shapes from the data's spec

    def init(self, key, spec=None):
        length = self._length(spec)
        self.policy.check_positions(length, where="the rows", fix="use shorter rows")
        params = self.policy.init_policy(key, length)
        ids = jnp.zeros((1, length), jnp.int32)
        fresh = jax.eval_shape(lambda: self.teacher.init(key, ids))["params"]
        teacher = with_initial_values(fresh, self.teacher_params, what="the teacher's weights")
        return {"params": params, "teacher": {"params": teacher}}

    # --------------------------------------------------------------- prepare
    def prepare(self, variables, batch, step: Step):
        """The batch's completions: the student's samples with probability ``lmbda``
        (current weights, compiled, no gradient), else the data's or the teacher's."""
        prompt, prompt_mask = batch["prompt"], batch["prompt_mask"].astype(bool)
        k_choose, k_sample = jax.random.split(step.key)
        new = self.max_new_tokens or batch["completion"].shape[1]

        def sampled(model, params):
            def draw(_):
                r = sample_completions(
                    model,
                    params,
                    prompt,
                    prompt_mask,
                    key=k_sample,
                    max_new_tokens=new,
                    sampling=self.sampling,
                    end_ids=self.end_ids,
                    pad_id=self.pad_id,
                )
                return r.completion, r.completion_mask

            return draw

        def data(_):
            return batch["completion"].astype(jnp.int32), batch["completion_mask"].astype(bool)

        student = sampled(self.student, variables["params"])
        other = sampled(self.teacher, variables["teacher"]["params"]) if self.seq_kd else data
        rows = prompt.shape[0]
        if self.lmbda >= 1:
            (completion, mask), on = student(None), jnp.ones((), bool)
        elif self.lmbda <= 0:
            (completion, mask), on = other(None), jnp.zeros((), bool)
        else:
            on = jax.random.uniform(k_choose) < self.lmbda
            completion, mask = jax.lax.cond(on, student, other, None)
        return {
            "prompt": prompt,
            "prompt_mask": prompt_mask,
            "completion": completion,
            "completion_mask": mask,
            "on_policy": jnp.broadcast_to(on.astype(jnp.float32), (rows,)),
            **({"example_mask": batch["example_mask"]} if "example_mask" in batch else {}),
        }

    # ------------------------------------------------------------------ loss
    def _hidden(self, module, params, tokens, extra, scored):
        """``(states, kernel, dtype)``: the states the output head reads at the scored
        positions (``scored``: a slice of axis 1) and the head, or the logits there,
        a placeholder kernel and dtype None for a module without a known head."""
        head = output_head(module, params)
        variables = {"params": nn.meta.unbox(params)}
        if head is None:
            logits = module.apply(variables, tokens, **extra)[:, scored]
            return logits, jnp.zeros((), jnp.float32), None
        _, hidden = module.apply(variables, tokens, return_hidden=True, **extra)
        return hidden[:, scored], *head

    def token_sums(self, variables, batch):
        """``(total, sums, tokens)``: the loss's weighted sum over the scored tokens
        (differentiable), the weighted sums of :func:`distillation_losses`' terms
        (metrics), and the token count (0 weight on prompt and padding)."""
        if self.text_key is not None:
            ids = batch[self.text_key]
            tokens, targets = ids[:, :-1], ids[:, 1:]
            extra = packed_inputs(
                batch, segment_ids_key=self.segment_ids_key, positions_key=self.positions_key
            )
            weights = target_weights(
                {k: v for k, v in batch.items() if k != "example_mask"},
                ids,
                loss_mask_key=self.loss_mask_key,
                segment_ids_key=self.segment_ids_key,
            )
            scored = slice(None)
        else:
            prompt, completion = batch["prompt"], batch["completion"]
            prompt_len, new = prompt.shape[1], completion.shape[1]
            tokens = jnp.concatenate([prompt, completion.astype(prompt.dtype)], axis=1)
            positions, mask = rollout_positions(batch["prompt_mask"].astype(bool), new)
            extra = {"positions": positions, "attention_mask": mask}
            targets = completion
            weights = batch["completion_mask"].astype(jnp.float32)
            scored = slice(prompt_len - 1, prompt_len - 1 + new)
        if "example_mask" in batch:  # padded rows of a last validation batch
            weights = weights * batch["example_mask"][:, None].astype(jnp.float32)
        student, kernel, s_dtype = self._hidden(
            self.student, variables["params"], tokens, extra, scored
        )
        scale, alpha = (1.0 - self.alpha) * self.temperature**2, self.alpha
        if self.stored_teacher:
            stored = tuple(batch[key] for key in (STORED_IDS, STORED_LOGPROBS, STORED_TAIL))

            def stored_sums(hs, k, stored, _, y, w):
                zs = _project(hs, k, s_dtype)  # [rows, chunk, vocab] float32
                ids, logprobs, tail = stored
                d = topk_divergence(
                    zs, ids, logprobs, tail, beta=self.beta, temperature=self.temperature
                )
                terms = {
                    "divergence": d,
                    "agreement": (  # the teacher's top id is a maximum of the student's
                        jnp.take_along_axis(zs, ids[..., :1].astype(jnp.int32), -1)[..., 0]
                        == jnp.max(zs, axis=-1)
                    ).astype(jnp.float32),
                    "nll": jax.nn.logsumexp(zs, axis=-1)
                    - jnp.take_along_axis(zs, y[..., None].astype(jnp.int32), -1)[..., 0],
                }
                per_token = scale * d + (alpha * terms["nll"] if alpha else 0.0)
                out = {k: jax.lax.stop_gradient(jnp.sum(v * w)) for k, v in terms.items()}
                return jnp.sum(per_token * w), out

            total, sums_ = chunked_sums(
                stored_sums,
                self.chunk_size,
                student,
                kernel,
                stored,
                jnp.zeros(()),
                targets,
                weights,
            )
            return total, sums_, jnp.sum(weights)
        teacher_params = jax.lax.stop_gradient(variables["teacher"]["params"])
        teacher, t_kernel, t_dtype = self._hidden(
            self.teacher, teacher_params, tokens, extra, scored
        )
        teacher_ids = None if self.teacher_ids is None else np.asarray(self.teacher_ids)

        def sums(hs, k, ht, tk, y, w):
            zs = _project(hs, k, s_dtype)  # [rows, chunk, vocab] float32
            zt = _project(jax.lax.stop_gradient(ht), jax.lax.stop_gradient(tk), t_dtype)
            if teacher_ids is not None:
                zt = jnp.take(zt, jnp.asarray(teacher_ids), axis=-1)
            terms = distillation_losses(zs, zt, y, beta=self.beta, temperature=self.temperature)
            per_token = scale * terms["divergence"]
            if alpha:
                per_token = per_token + alpha * terms["nll"]
            out = {k: jax.lax.stop_gradient(jnp.sum(v * w)) for k, v in terms.items()}
            return jnp.sum(per_token * w), out

        total, sums_ = chunked_sums(
            sums, self.chunk_size, student, kernel, teacher, t_kernel, targets, weights
        )
        return total, sums_, jnp.sum(weights)

    def _metrics(self, sums, tokens):
        out = {k: Weighted(total=v, weight=tokens) for k, v in sums.items()}
        out["tokens"] = Summed(tokens)
        return out

    def loss(self, variables, batch, step: Step):
        total, sums, tokens = self.token_sums(variables, batch)
        metrics = self._metrics(sums, tokens)
        if "on_policy" in batch:
            metrics["on_policy"] = Weighted.mean(batch["on_policy"])
        return Weighted(total=total, weight=tokens), metrics

    def evaluate(self, variables, batch, step: Step):
        _, sums, tokens = self.token_sums(variables, batch)
        return self._metrics(sums, tokens)

    # ------------------------------------------------------ checks, export
    def check_batch(self, batch):
        super().check_batch(batch)
        keys = (self.text_key,) if self.text_key is not None else ("prompt", "completion")
        for key in keys:
            if key in batch:
                self.policy.check_ids(batch[key], key=key)
        if self.positions_key is not None and self.positions_key in batch:
            check_packed_positions(
                np.asarray(batch[self.positions_key]),
                self.policy.max_seq_len,
                key=self.positions_key,
                what=type(self).__name__,
            )
        if self.text_key is None and "prompt" in batch:
            new = self.max_new_tokens or np.shape(batch.get("completion", ((),)))[1]
            self.policy.check_rollout_length(np.shape(batch["prompt"])[1], new)
            if self.lmbda > 0 and "completion" in batch and self.max_new_tokens is not None:
                width = np.shape(batch["completion"])[1]
                if width != self.max_new_tokens:
                    raise ValueError(
                        f"DistillationObjective: the data's completions are {width} tokens "
                        f"wide but max_new_tokens={self.max_new_tokens}; sampled and data "
                        f"batches must have one shape: make them equal (or max_new_tokens=None)"
                    )

    def preview(self, variables, key):
        return self.policy.preview(variables["params"], key, tokenizer=self.tokenizer)

    def export(self, variables):
        return self.policy.export(variables["params"], tokenizer=self.tokenizer)
