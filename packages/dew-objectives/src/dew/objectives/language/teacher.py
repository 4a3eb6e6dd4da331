"""The frozen teacher of :class:`~dew.objectives.language.distillation.DistillationObjective`:
its module, weights and tokenizer from what the user gave (a module and weights, a
``dew.sampling.Pretrained``, the student's architecture, or a stand-in of no weights
when its top-k log-probs are stored), and the check that its ids mean the student's."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from dew.objectives.cores.policy import check_same_vocabulary, vocab_size_of


class StoredTeacher(nn.Module):
    """The teacher role of ``stored_teacher=True``: no weights (one empty array) and
    never run; its vocabulary is the student's, for the checks."""

    vocab_size: int | None = None

    @nn.compact
    def __call__(self, tokens, **_):
        self.param("none", nn.initializers.zeros, (0,), jnp.float32)
        return jnp.zeros((*tokens.shape, self.vocab_size or 1), jnp.float32)


def resolve_teacher(
    teacher, teacher_params, teacher_tokenizer, *, student, stored: bool
) -> tuple[Any, Any, Any]:
    """``(module, weights, tokenizer)`` of the teacher: a ``Pretrained``'s parts, the
    student's module for a same-architecture teacher (``teacher`` None), or a stand-in
    of no weights when the teacher's top-k are ``stored``."""
    if stored:  # a frozen role of no weights: the stored top-k stand in
        none = {"none": np.zeros((0,), np.float32)}
        return StoredTeacher(vocab_size=vocab_size_of(student)), none, None
    params, tokenizer = teacher_params, teacher_tokenizer
    if hasattr(teacher, "params") and hasattr(teacher, "model"):  # a Pretrained
        tokenizer = getattr(teacher, "tokenizer", None) if tokenizer is None else tokenizer
        params = teacher.params if params is None else params
        teacher = teacher.model
    return (student if teacher is None else teacher), params, tokenizer


def check_teacher_vocabulary(
    student, teacher, teacher_ids, *, tokenizers: tuple[Any, Any], what: str
) -> None:
    """The teacher's ids are the student's (the vocabularies and, when both are known,
    the ``tokenizers`` agree), or ``teacher_ids`` maps every student id into the
    teacher's vocabulary; a ValueError (TypeError for a malformed map) otherwise."""
    student_vocab, teacher_vocab = vocab_size_of(student), vocab_size_of(teacher)
    if teacher_ids is None:
        check_same_vocabulary(
            student,
            teacher,
            what=what,
            names=("student", "teacher"),
            tokenizers=tokenizers,
            fix=(
                f"use a teacher with the student's tokenizer, or pass teacher_ids= (int "
                f"[{student_vocab}]: the teacher id of each student id; "
                f"np.arange({student_vocab}) when the student's ids are the teacher's first "
                f"ones, a teacher with extra rows)"
            ),
        )
        return
    ids = np.asarray(teacher_ids)
    if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
        raise TypeError(f"teacher_ids must be a 1-d integer array, got {ids.dtype} {ids.shape}")
    if student_vocab is not None and ids.shape[0] != student_vocab:
        raise ValueError(
            f"{what}: teacher_ids has {ids.shape[0]} entries, the student's vocabulary "
            f"{student_vocab} ids; give the teacher id of every student id"
        )
    if ids.size and (ids.min() < 0 or (teacher_vocab is not None and ids.max() >= teacher_vocab)):
        raise ValueError(
            f"{what}: teacher_ids holds ids in [{ids.min()}, {ids.max()}], outside the "
            f"teacher's vocabulary of {teacher_vocab} ids"
        )
