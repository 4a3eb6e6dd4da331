"""Divergences between a student's and a teacher's token distributions, shared by the
distillation families (``language.distillation``, ``language.classifier_distillation``,
``language.teacher_topk``).

:func:`divergence` is the generalized Jensen-Shannon divergence of GKD divided by
``beta (1 - beta)``, continuous on ``[0, 1]`` with the forward KL at 0 and the reverse
KL at 1 (the derivation is in ``dew.objectives.language.distillation``'s docstring);
:func:`distillation_losses` adds the hard-label cross-entropy and the agreement;
:func:`topk_divergence` is the same over a stored teacher top-k and its tail.
:func:`chunked_sums` computes the losses over chunks of positions from the final hidden
states (:func:`output_head`), so no ``[batch, length, vocab]`` float32 logits are held.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.dense import token_rows
from dew.nn.keywords import real_number

__all__ = [
    "agreement",
    "check_beta",
    "check_fraction",
    "check_temperature",
    "chunked_sums",
    "distillation_losses",
    "divergence",
    "output_head",
    "project_logits",
    "tail_logsumexp",
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


def tail_logsumexp(z: jax.Array, ids: jax.Array) -> jax.Array:
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
    s_tail = tail_logsumexp(z, ids) - logz[..., 0]
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


def project_logits(hidden, kernel, dtype):
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
