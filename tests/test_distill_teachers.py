"""Teachers from anywhere (issue 27, item 3): a GPT-2-format Hugging Face directory
read by ``Pretrained.load``, and a Dew run's checkpoints read by ``load_model``, each
of another family and size than a Qwen2-style student, distilled by
``DistillationObjective`` through ``dew.train.Trainer``.

For each: the first step's logged loss and metrics equal a numpy float64
transcription (forward KL at temperature 2, times T^2) from each model applied
directly, row by row without its padding, so the teacher distribution the objective
uses is the loaded teacher's own (``teacher_nll`` pins its log-prob of every target,
the divergence its whole distribution); then the loss falls over 3 steps."""

import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer, models
from dew.nn.testing import TINY_GPT2, TINY_LM
from dew.objectives.language.distillation import DistillationObjective
from dew.objectives.language.lm import LMObjective
from dew.sampling import Pretrained
from dew.train import Checkpoints, MeshSpec, Trainer, load_model

ONE = MeshSpec(data=1, devices=jax.devices()[:1])
ROWS, P, N, STEPS, T = 4, 3, 5, 3, 2.0
# Qwen2-style (RoPE, RMSNorm, SwiGLU, q/k/v biases, tied embeddings), one narrow layer
STUDENT = CausalTransformer(**{**TINY_LM, "num_layers": 1, "use_qkv_bias": True,
                               "tie_embeddings": True})  # fmt: skip
# GPT-2 (learned positions, LayerNorm, GELU, biases, tied head): twice as wide, 3 layers
GPT2_TEACHER = CausalTransformer(
    **{**TINY_GPT2, "emb_features": 32, "num_layers": 3, "mlp_features": 64}
)
# Llama-style (no biases, its own lm_head), wider and deeper than the student
LLAMA_TEACHER = dict(TINY_LM, emb_features=32, num_layers=3, num_heads=2, num_kv_heads=1,
                     mlp_features=48, rope_theta=500.0)  # fmt: skip


def fixed_batch():
    """Left-padded prompts (row 1 and 3 one shorter), right-padded completions."""
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((ROWS, P), bool)
    prompt_mask[1::2, 0] = False
    lengths = np.array([5, 2, 4, 1])
    completion_mask = np.arange(N)[None] < lengths[:, None]
    return dict(
        prompt=np.where(prompt_mask, rng.integers(1, 32, (ROWS, P)), 0).astype(np.int32),
        prompt_mask=prompt_mask,
        completion=np.where(completion_mask, rng.integers(1, 32, (ROWS, N)), 0).astype(np.int32),
        completion_mask=completion_mask,
    )


BATCH = fixed_batch()


def sharp_params(model, seed):
    """A teacher sharper than its near-uniform init (every weight times 3)."""
    params = nn.unbox(jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32)))
    return jax.device_get(jax.tree.map(lambda x: 3.0 * x, params["params"]))


# ------------------------------------------------------------ numpy float64
def log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def scored_logits(model, params):
    """``[rows, N, vocab]``: the model's logits that predict each completion token,
    from each row applied alone without its left padding (positions from 0, plain
    causal attention: none of the objective's position or mask code)."""
    apply = jax.jit(model.apply)
    out = []
    for r in range(ROWS):
        prompt = BATCH["prompt"][r][BATCH["prompt_mask"][r]]
        ids = np.concatenate([prompt, BATCH["completion"][r]])[None]
        logits = np.asarray(apply({"params": params}, ids))  # [1, length, vocab]
        out.append(logits[0, len(prompt) - 1 : len(prompt) - 1 + N])
    return np.stack(out)


def numpy_metrics(student, student_params, teacher, teacher_params):
    """The loss (``T^2`` forward KL at ``T``), divergence and ``teacher_nll``: means
    over the completion tokens."""
    zs = scored_logits(student, student_params)
    zt = scored_logits(teacher, teacher_params)
    s, t = log_softmax(zs / T), log_softmax(zt / T)
    kl = (np.exp(t) * (t - s)).sum(-1)  # KL(p_T || p_S) at T, [rows, N]
    teacher_nll = -np.take_along_axis(log_softmax(zt), BATCH["completion"][..., None], -1)[..., 0]
    w = BATCH["completion_mask"].astype(np.float64)
    mean = lambda x: (x * w).sum() / w.sum()  # noqa: E731
    return dict(loss=T**2 * mean(kl), divergence=mean(kl), teacher_nll=mean(teacher_nll))


# ------------------------------------------------------------------ training
def data(batches):
    def train(partition):
        return (
            {k: v[partition.slice(ROWS)] for k, v in b.items()} for b in itertools.cycle(batches)
        )

    return Dataset(train=train, val=None, records=len(batches) * ROWS, batch=ROWS)


def distil_and_check(run_dir, **teacher):
    """Distil ``STUDENT`` from ``teacher`` (``teacher=`` and maybe ``teacher_params=``)
    on ``BATCH`` for ``STEPS`` steps; check the first step against numpy and the fall."""
    objective = DistillationObjective(
        student=STUDENT, **teacher, beta=0.0, temperature=T, chunk_size=2
    )
    assert objective.teacher_module.emb_features != STUDENT.emb_features
    assert objective.teacher_module.num_layers != STUDENT.num_layers
    trainer = Trainer(
        objective, optax.adam(1e-2), key=jax.random.key(0), mesh=ONE, run_dir=str(run_dir)
    )
    initial = jax.device_get(trainer.init_state().variables())
    trainer.fit(data([BATCH]), steps=STEPS, log_every=1)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == STEPS
    want = numpy_metrics(
        STUDENT, initial["params"]["policy"], objective.teacher_module, initial["teacher"]["params"]
    )
    for key, value in want.items():
        np.testing.assert_allclose(train[0][key], value, rtol=1e-5, err_msg=key)
    assert train[0]["tokens"] == BATCH["completion_mask"].sum()
    losses = [r["loss"] for r in train]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    return initial


@pytest.mark.slow
def test_gpt2_format_teacher_from_pretrained_load(tmp_path):
    params = sharp_params(GPT2_TEACHER, seed=2)
    path = Pretrained(model=GPT2_TEACHER, params=params, format="gpt2").save(tmp_path / "gpt2")
    assert json.loads((path / "config.json").read_text())["model_type"] == "gpt2"
    teacher = Pretrained.load(path)
    assert teacher.format == "gpt2" and teacher.model.position_embedding == "learned"
    assert teacher.model.norm == "layer" and teacher.model.use_bias
    initial = distil_and_check(tmp_path / "run", teacher=teacher)
    # the frozen role holds the directory's weights, unchanged
    jax.tree.map(np.testing.assert_array_equal, initial["teacher"]["params"], params)


@pytest.mark.slow
def test_teacher_from_a_dew_run_via_load_model(tmp_path):
    """A Dew run (LMObjective, 2 steps, Checkpoints) is the teacher: ``load_model``
    rebuilds its module from the checkpoint's record and its trained weights."""
    model = models.build("causal_transformer", **LLAMA_TEACHER)
    rng = np.random.default_rng(1)
    rows = [{"text": rng.integers(1, 32, (ROWS, P + N + 1)).astype(np.int32)} for _ in range(2)]
    lm = Trainer(
        LMObjective(model=model, seq_len=P + N, init_params=sharp_params(model, seed=3)),
        optax.adam(1e-2),
        key=jax.random.key(1),
        mesh=ONE,
        checkpoints=Checkpoints(tmp_path / "teacher_run"),
        progress=False,
    )
    trained = jax.device_get(lm.fit(data(rows), steps=2, log_every=0).params)
    module, params = load_model(tmp_path / "teacher_run")
    assert models.config_of(module) == models.config_of(model)
    jax.tree.map(np.testing.assert_array_equal, params, trained)
    distil_and_check(tmp_path / "run", teacher=module, teacher_params=jax.device_get(params))
