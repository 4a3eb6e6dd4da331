"""Distil a Hugging Face-format teacher into a smaller student, saved in the teacher's format.

The teacher is a directory ``Pretrained.load`` reads (any supported Hugging Face
causal-LM family). Without ``--teacher`` the example writes one first: a Dew
``CausalTransformer`` over the byte tokenizer with sharp random weights, saved as
Llama (what a Dew run's ``Pretrained.save(..., format="llama")`` writes). The
student (half the width, one layer) learns it with ``DistillationObjective``:
generalized JSD (beta 0.5), half the batches sampled by the student in the
compiled prepare phase (on-policy, lmbda 0.5), the others sampled by the teacher
(sequence-level KD), so the data is prompts only. It prints the divergence to the
teacher on held-out prompts before and after, and saves the student in the
teacher's format, which ``Pretrained.load`` (and transformers) read back.

From the repository root (``uv run`` installs what it needs; nothing besides Dew):

    uv run --locked python examples/distill_pretrained.py [--steps 60] [--teacher DIR]
"""

import argparse
import itertools
import pathlib

import jax
import numpy as np
import optax

from dew.data import ByteTokenizer, Dataset
from dew.nn import CausalTransformer
from dew.objectives import Step
from dew.objectives.language.distillation import DistillationObjective
from dew.sampling import Pretrained, Sampling
from dew.train import MeshSpec, Trainer

PROMPT, NEW, ROWS = 8, 8, 16
RUN = pathlib.Path("runs/distill_pretrained")
WORDS = "dew trains jax models on one cpu or a pod with the same code and data".split()


def write_teacher(path: pathlib.Path) -> pathlib.Path:
    """A Llama-format directory of a small, sharp random causal LM."""
    model = CausalTransformer(
        vocab_size=ByteTokenizer.vocab_size,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_features=128,
        max_seq_len=PROMPT + NEW,
    )
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: rng.normal(0, 0.3, s.value.shape).astype(np.float32),
        shapes["params"],
        is_leaf=lambda x: hasattr(x, "value"),
    )
    Pretrained(model=model, params=params, tokenizer=ByteTokenizer(), format="llama").save(path)
    return path


def prompts(tokenizer, seed: int) -> dict[str, np.ndarray]:
    """``ROWS`` left-padded prompts of up to ``PROMPT`` tokens: a few random words."""
    rng = np.random.default_rng(seed)
    prompt = np.zeros((ROWS, PROMPT), np.int32)
    mask = np.zeros((ROWS, PROMPT), bool)
    for r in range(ROWS):
        ids = tokenizer.encode(" ".join(rng.choice(WORDS, 3)))[-PROMPT:]
        prompt[r, PROMPT - len(ids) :], mask[r, PROMPT - len(ids) :] = ids, True
    return dict(prompt=prompt, prompt_mask=mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--teacher", type=pathlib.Path, default=None)
    args = parser.parse_args()

    teacher = Pretrained.load(args.teacher or write_teacher(RUN / "teacher"))
    tokenizer = teacher.tokenizer
    student = teacher.model.clone(
        emb_features=teacher.model.emb_features // 2, num_layers=1, mlp_features=64
    )
    objective = DistillationObjective(
        student=student,
        teacher=teacher,  # its module and weights: a frozen role
        beta=0.5,
        lmbda=0.5,
        seq_kd=True,
        max_new_tokens=NEW,
        sampling=Sampling(temperature=1.0),
        tokenizer=tokenizer,
    )
    batches = [prompts(tokenizer, seed) for seed in range(8)]
    data = Dataset(
        train=lambda p: (
            {k: v[p.slice(ROWS)] for k, v in b.items()} for b in itertools.cycle(batches)
        ),
        val=None,
        records=8 * ROWS,
        batch=ROWS,
    )
    trainer = Trainer(
        objective,
        optax.adam(3e-3),
        key=jax.random.key(0),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        run_dir=str(RUN / "run"),
    )

    # held out: the teacher's samples of other prompts, scored by both models
    seq_kd = DistillationObjective(
        student=student, teacher=teacher, beta=0.5, seq_kd=True, max_new_tokens=NEW
    )
    at = Step(index=np.int32(0), key=jax.random.key(1))
    frozen = {"teacher": {"params": teacher.params}}
    no_student = {"params": {"policy": {}}, **frozen}  # seq_kd samples the teacher alone
    held_out = jax.jit(seq_kd.prepare)(no_student, prompts(tokenizer, 99), at)
    evaluate = jax.jit(seq_kd.evaluate)

    def divergence(params):
        variables = {"params": {"policy": params}, **frozen}
        return float(evaluate(variables, held_out, at)["divergence"].value)

    before = divergence(jax.device_get(trainer.init_state().params))
    state = trainer.fit(data, steps=args.steps, log_every=max(1, args.steps // 4))
    after = divergence(jax.device_get(state.params))
    print(f"divergence to the teacher on held-out prompts: {before:.4f} -> {after:.4f}")

    out = Pretrained(
        model=student,
        params=jax.device_get(state.params),
        tokenizer=tokenizer,
        format=teacher.format,
    ).save(RUN / "student")
    again = Pretrained.load(out)
    print(f"wrote the student to {out} ({again.format}, {again.model.emb_features} wide)")


if __name__ == "__main__":
    main()
