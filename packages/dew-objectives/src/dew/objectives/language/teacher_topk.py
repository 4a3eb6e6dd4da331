"""Offline distillation: the teacher's top-k log-probs computed once, and the loss on them.

:func:`write_teacher_topk` runs the teacher over rows of ids a single time and
stores, per position, its ``k`` most likely next ids, their log-probs at the
temperature ``T`` and the log of the rest of the mass (the tail), with
:class:`dew.data.TopKWriter`; :class:`dew.data.TeacherTopK` reads them back as a
checkpointed Grain reader, and ``DistillationObjective(stored_teacher=True)``
trains on them without running (or holding) the teacher.

The loss on the stored support, :func:`topk_divergence`, is the divergence of the
two distributions coarsened to ``k + 1`` categories: the teacher's k ids, each with
its own probability, and one **tail** category holding the mass of every other id:

    p_T^K = (p_T(v_1), ..., p_T(v_k), 1 - sum_i p_T(v_i))
    p_S^K = (p_S(v_1), ..., p_S(v_k), 1 - sum_i p_S(v_i))
    loss  = D_beta(p_T^K, p_S^K)

with both models' probabilities normalised over the whole vocabulary at ``T``
(nothing renormalised to the k ids). It is a true divergence for every beta (the
reverse KL stays finite: the student's mass off the teacher's top k is compared
with the teacher's tail, not with 0), it is at most the full-vocabulary divergence
(data processing), and it equals it when ``k`` is the vocabulary. Renormalising the
teacher to its top k (Tunix's ``distill_top_k``) instead gives the forward KL an
extra ``log sum_i p_T(v_i)`` term and leaves the reverse KL infinite. The
student's tail is ``logsumexp`` of its logits with the k ids masked, so a tail of
1e-30 is not lost in ``1 - sum``; the teacher's comes from the writer the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.cores.divergences import check_temperature, tail_logsumexp, topk_divergence
from dew.objectives.language.lm import packed_inputs

__all__ = ["teacher_topk", "topk_divergence", "write_teacher_topk"]


def teacher_topk(teacher_logits: jax.Array, *, k: int, temperature: float):
    """``(ids [..., k] int32, logprobs [..., k], tail [...])`` of ``softmax(z / T)``:
    the k most likely ids (most likely first), their log-probs and the log of the
    mass of all other ids, float32."""
    z = teacher_logits.astype(jnp.float32) / temperature
    logz = jax.nn.logsumexp(z, axis=-1)
    top, ids = jax.lax.top_k(z, k)
    return ids.astype(jnp.int32), top - logz[..., None], tail_logsumexp(z, ids) - logz


def write_teacher_topk(
    path,
    batches: Iterable[Mapping[str, np.ndarray]],
    *,
    teacher,
    teacher_params,
    k: int,
    temperature: float = 1.0,
    text_key: str = "text",
    segment_ids_key: str | None = None,
    positions_key: str | None = None,
    rows_per_shard: int = 1024,
    metadata: Mapping[str, str] | None = None,
):
    """Run ``teacher`` once over ``batches`` and store its top-k (module docstring).

    path: a new directory (:class:`dew.data.TopKWriter`).
    batches: numpy batches of rows of ids, ``batch[text_key] [rows, length + 1]``
      (an LM/SFT reader's), each stored whole with its other columns, e.g.
      ``itertools.islice(SFTExamples(...).load(batch=64).train(Partition()), n)``
      (the first ``records / batch`` batches of the endless stream are one epoch).
    teacher: the teacher's module, or a ``dew.sampling.Pretrained``.
    teacher_params: its weights (None with a ``Pretrained``).
    k: ids kept per position (<= the teacher's vocabulary).
    temperature: the temperature of the log-probs, the distillation loss's.
    segment_ids_key, positions_key: packed rows' columns, handed to the teacher.
    rows_per_shard, metadata: as for :class:`dew.data.TopKWriter`.
    Returns the directory.
    """
    from dew.data.teacher_topk import IDS, LOGPROBS, TAIL, TopKWriter
    from dew.objectives.cores.policy import vocab_size_of

    check_temperature(temperature)
    if hasattr(teacher, "params") and hasattr(teacher, "model"):  # a Pretrained
        teacher_params = teacher.params if teacher_params is None else teacher_params
        teacher = teacher.model
    vocab = vocab_size_of(teacher)
    if not 1 <= k <= (vocab or k):
        raise ValueError(f"k={k} must be in [1, the teacher's vocabulary of {vocab} ids]")
    params = jax.device_put(nn.meta.unbox(teacher_params))

    @jax.jit
    def forward(params, batch):
        ids = batch[text_key][:, :-1]
        extra = packed_inputs(batch, segment_ids_key=segment_ids_key, positions_key=positions_key)
        logits = teacher.apply({"params": params}, ids, **extra)  # [rows, length, vocab]
        return teacher_topk(logits, k=k, temperature=temperature)

    info = {"teacher": type(teacher).__name__, **dict(metadata or {})}
    with TopKWriter(
        path, k=k, temperature=temperature, vocab_size=vocab or 0,
        rows_per_shard=rows_per_shard, metadata=info,
    ) as writer:  # fmt: skip
        for batch in batches:
            batch = {key: np.asarray(value) for key, value in batch.items()}
            if "example_mask" in batch:  # a padded validation batch: real rows only
                batch = {key: v[batch["example_mask"]] for key, v in batch.items()}
                batch.pop("example_mask")
            read = {key: batch[key] for key in (text_key, segment_ids_key, positions_key) if key}
            ids, logprobs, tail = jax.device_get(forward(params, read))
            writer.add({**batch, IDS: ids, LOGPROBS: logprobs, TAIL: tail})
    return writer.path
