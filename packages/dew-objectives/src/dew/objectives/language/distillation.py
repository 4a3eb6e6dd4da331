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
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew.objectives.contract import registry
from dew.objectives.contract.batch import FLOATS, IDS, MASK, BatchField
from dew.objectives.contract.objective import (
    Objective,
    Role,
    Step,
    set_canonical,
    with_initial_values,
)
from dew.objectives.contract.weighted import Weighted
from dew.objectives.cores.divergences import (
    check_beta,
    check_fraction,
    check_temperature,
    chunked_sums,
    distillation_losses,
    divergence,
    topk_divergence,
)
from dew.objectives.cores.policy import CausalPolicy, policy_of
from dew.objectives.cores.rollouts import prompt_fields, sample_completions
from dew.objectives.language.distillation_loss import (
    STORED_IDS,
    STORED_LOGPROBS,
    STORED_TAIL,
    scored_inputs,
    token_metrics,
    token_sums,
)
from dew.objectives.language.lm import check_packed_positions
from dew.objectives.language.teacher import check_teacher_vocabulary, resolve_teacher
from dew.sampling import Sampling


def init_length(spec, student, *, text_key: str | None, max_new_tokens: int | None) -> int:
    """The sequence length to initialise at: the data's rows of ids (less the last
    target), its prompt plus completion width, else the student's ``max_seq_len`` (8)."""
    if spec is None:
        return int(getattr(student, "max_seq_len", None) or 8)
    if text_key is not None and text_key in spec:
        return int(tuple(spec[text_key].shape)[0]) - 1
    if "prompt" in spec:
        new = max_new_tokens
        if new is None and "completion" in spec:
            new = int(tuple(spec["completion"].shape)[0])
        return int(tuple(spec["prompt"].shape)[0]) + (new or 0)
    return int(getattr(student, "max_seq_len", None) or 8)


__all__ = [
    "DistillationObjective",
    "chunked_sums",
    "distillation_losses",
    "divergence",
    "topk_divergence",
]


@registry.register("distillation")
@dataclasses.dataclass(frozen=True, eq=False)
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
    _: dataclasses.KW_ONLY  # the model may come first, positional (the seed's form)
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
        set_canonical(
            self,
            beta=check_beta(self.beta),
            temperature=check_temperature(self.temperature),
            alpha=check_fraction("alpha", self.alpha, "the weight of the hard-label cross-entropy"),
            lmbda=check_fraction(
                "lmbda", self.lmbda, "the fraction of batches the student samples"
            ),
        )
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or int(self.chunk_size) < 1
        ):
            raise ValueError(f"chunk_size must be >= 1 positions or None, got {self.chunk_size!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 tokens, got {self.max_new_tokens}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a dew.sampling.Sampling, got {self.sampling!r}")
        if self.text_key is not None and (self.lmbda > 0 or self.seq_kd):
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
        if self.teacher_weights is None:
            raise ValueError(
                f"{what} needs the teacher's weights: pass teacher_params= (a trained run's "
                f"params) or teacher=Pretrained.load(directory)"
            )
        given = (self.teacher, self.teacher_params, self.teacher_tokenizer)
        teacher_tokenizer = resolve_teacher(
            *given, student=self.student, stored=self.stored_teacher
        )[2]
        check_teacher_vocabulary(
            self.student,
            self.teacher_module,
            self.teacher_ids,
            tokenizers=(self.policy.tokenizer, teacher_tokenizer),
            what=what,
        )

    @functools.cached_property
    def teacher_module(self):
        """The teacher's module (a ``Pretrained``'s, the student's architecture, or a
        stand-in of no weights with ``stored_teacher``: :func:`resolve_teacher`)."""
        given = (self.teacher, self.teacher_params, self.teacher_tokenizer)
        return resolve_teacher(*given, student=self.student, stored=self.stored_teacher)[0]

    @functools.cached_property
    def teacher_weights(self):
        """The teacher's weights (``teacher_params``, or a ``Pretrained``'s)."""
        given = (self.teacher, self.teacher_params, self.teacher_tokenizer)
        return resolve_teacher(*given, student=self.student, stored=self.stored_teacher)[1]

    @property
    def model(self):
        """The trained model: the student."""
        return self.student

    @functools.cached_property
    def policy(self) -> CausalPolicy:
        """The causal-LM core of the student: its tokenizer and initial weights."""
        return policy_of(self)

    @property
    def phases(self) -> tuple[str, ...]:
        """A prepare phase only when it samples (on-policy or sequence-level)."""
        return ("prepare",) if self.lmbda > 0 or self.seq_kd else ()

    # ----------------------------------------------------------------- roles
    def roles(self):
        return (
            Role(name="policy", module=self.student),
            Role(name="teacher", module=self.teacher_module, trained=False),
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

    def init(self, key, spec=None):
        length = init_length(
            spec, self.student, text_key=self.text_key, max_new_tokens=self.max_new_tokens
        )
        self.policy.check_positions(length, where="the rows", fix="use shorter rows")
        params = self.policy.init_policy(key, length)
        ids = jnp.zeros((1, length), jnp.int32)
        fresh = jax.eval_shape(lambda: self.teacher_module.init(key, ids))["params"]
        teacher = with_initial_values(fresh, self.teacher_weights, what="the teacher's weights")
        return {"params": {"policy": params}, "teacher": {"params": teacher}}

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
                    end_ids=tuple(int(e) for e in self.end_ids),
                    pad_id=self.pad_id,
                )
                return r.completion, r.completion_mask

            return draw

        def data(_):
            return batch["completion"].astype(jnp.int32), batch["completion_mask"].astype(bool)

        student = sampled(self.student, variables["params"]["policy"])
        other = (
            sampled(self.teacher_module, variables["teacher"]["params"]) if self.seq_kd else data
        )
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
    def loss(self, variables, batch, step: Step):
        """The loss over the scored tokens (:func:`token_sums`) and its terms' per-token
        means; ``on_policy`` with a prepare phase."""
        inputs = scored_inputs(
            batch,
            text_key=self.text_key,
            loss_mask_key=self.loss_mask_key,
            segment_ids_key=self.segment_ids_key,
            positions_key=self.positions_key,
        )
        stored, teacher_ids = None, self.teacher_ids
        if teacher_ids is not None:
            teacher_ids = np.asarray(teacher_ids, np.int32)
        if self.stored_teacher:
            stored = tuple(batch[key] for key in (STORED_IDS, STORED_LOGPROBS, STORED_TAIL))
        total, sums, tokens = token_sums(
            self.student,
            variables["params"]["policy"],
            self.teacher_module,
            None if self.stored_teacher else variables["teacher"]["params"],
            inputs,
            stored=stored,
            teacher_ids=None
            if self.teacher_ids is None
            else np.asarray(self.teacher_ids, np.int32),
            beta=self.beta,
            temperature=self.temperature,
            alpha=self.alpha,
            chunk_size=self.chunk_size,
        )
        metrics = token_metrics(sums, tokens)
        if "on_policy" in batch:
            metrics["on_policy"] = Weighted.mean(batch["on_policy"])
        return Weighted(total=total, weight=tokens), metrics

    def evaluate(self, variables, batch, step: Step):
        """The loss's per-token means on a validation batch."""
        metrics = self.loss(variables, batch, step)[1]
        metrics.pop("on_policy", None)
        return metrics

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
        return self.policy.preview(variables["params"]["policy"], key)

    def export(self, variables):
        return self.policy.export(variables["params"]["policy"])
