"""The distillation loss of :class:`~dew.objectives.language.distillation.DistillationObjective`
as sums over scored tokens (the math is in its module docstring): which tokens a batch
scores (:func:`scored_inputs`), the states each model's output head reads there
(:func:`head_inputs`), and the chunked sums of the loss and its terms
(:func:`token_sums`), from a teacher that runs or from its stored top-k."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.objectives.contract.weighted import Summed, Weighted
from dew.objectives.cores.divergences import (
    chunked_sums,
    distillation_losses,
    output_head,
    project_logits,
    topk_divergence,
)
from dew.objectives.cores.logprobs import rollout_positions
from dew.objectives.language.lm import packed_inputs, target_weights

STORED_IDS, STORED_LOGPROBS, STORED_TAIL = (
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "teacher_tail_logprob",
)  # the batch keys of dew.data.TeacherTopK


def scored_inputs(
    batch,
    *,
    text_key: str | None,
    loss_mask_key: str | None,
    segment_ids_key: str | None,
    positions_key: str | None,
):
    """``(tokens, extra, targets, weights, scored)``: the models' input ids and
    keywords, the targets and their weights (0 on prompt and padding) and the scored
    positions (a slice of axis 1), from rows of ids (``text_key``) or from prompts and
    completions."""
    if text_key is not None:
        ids = batch[text_key]
        tokens, targets = ids[:, :-1], ids[:, 1:]
        extra = packed_inputs(batch, segment_ids_key=segment_ids_key, positions_key=positions_key)
        weights = target_weights(
            {k: v for k, v in batch.items() if k != "example_mask"},
            ids,
            loss_mask_key=loss_mask_key,
            segment_ids_key=segment_ids_key,
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
    return tokens, extra, targets, weights, scored


def head_inputs(module, params, tokens, extra, scored):
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


def token_sums(
    student,
    student_params,
    teacher,
    teacher_params,
    inputs,
    *,
    stored: tuple[Any, Any, Any] | None,
    teacher_ids,
    beta: float,
    temperature: float,
    alpha: float,
    chunk_size: int | None,
):
    """``(total, sums, tokens)``: the loss's weighted sum over the scored tokens of
    ``inputs`` (:func:`scored_inputs`; differentiable in ``student_params``), the
    weighted sums of :func:`distillation_losses`' terms (metrics), and the token count.
    ``stored``: the teacher's top-k ``(ids, logprobs, tail)`` instead of running it;
    ``teacher_ids``: int32 ``[student vocab]`` teacher id of each student id, or None."""
    tokens, extra, targets, weights, scored = inputs
    student_states, kernel, s_dtype = head_inputs(student, student_params, tokens, extra, scored)
    scale = (1.0 - alpha) * temperature**2
    if stored is not None:

        def stored_sums(hs, k, stored, _, y, w):
            zs = project_logits(hs, k, s_dtype)  # [rows, chunk, vocab] float32
            ids, logprobs, tail = stored
            d = topk_divergence(zs, ids, logprobs, tail, beta=beta, temperature=temperature)
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
            chunk_size,
            student_states,
            kernel,
            stored,
            jnp.zeros(()),
            targets,
            weights,
        )
        return total, sums_, jnp.sum(weights)
    teacher_params = jax.lax.stop_gradient(teacher_params)
    teacher_states, t_kernel, t_dtype = head_inputs(teacher, teacher_params, tokens, extra, scored)

    def sums(hs, k, ht, tk, y, w):
        zs = project_logits(hs, k, s_dtype)  # [rows, chunk, vocab] float32
        zt = project_logits(jax.lax.stop_gradient(ht), jax.lax.stop_gradient(tk), t_dtype)
        if teacher_ids is not None:
            zt = jnp.take(zt, jnp.asarray(teacher_ids), axis=-1)
        terms = distillation_losses(zs, zt, y, beta=beta, temperature=temperature)
        per_token = scale * terms["divergence"]
        if alpha:
            per_token = per_token + alpha * terms["nll"]
        out = {k: jax.lax.stop_gradient(jnp.sum(v * w)) for k, v in terms.items()}
        return jnp.sum(per_token * w), out

    total, sums_ = chunked_sums(
        sums, chunk_size, student_states, kernel, teacher_states, t_kernel, targets, weights
    )
    return total, sums_, jnp.sum(weights)


def token_metrics(sums: Mapping[str, jax.Array], tokens) -> dict[str, Any]:
    """Each term's weighted sum as a per-token mean, and the token count."""
    out = {k: Weighted(total=v, weight=tokens) for k, v in sums.items()}
    out["tokens"] = Summed(tokens)
    return out
