"""Fine-tuning a Pretrained checkpoint: the objective starts from its weights,
the Trainer trains them on the 8-device mesh, and the pipeline of the result
saves a Hugging Face checkpoint that loads back and generates the same text."""

import itertools

import jax
import numpy as np
import optax
import pytest

from dew.data import ByteTokenizer, Dataset, HFTokenizer
from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.sampling import Pretrained, TextGeneration
from dew.train import Trainer

MODEL = CausalTransformer(
    vocab_size=ByteTokenizer.vocab_size,
    emb_features=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_features=64,
    max_seq_len=32,
)


def random_params(model, seed=0):
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 4), np.int32))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.normal(0, 0.2, s.value.shape).astype(np.float32),
        shapes["params"],
        is_leaf=lambda x: hasattr(x, "value"),
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    Pretrained(
        model=MODEL, params=random_params(MODEL), tokenizer=ByteTokenizer(), format="llama"
    ).save(path)
    return Pretrained.load(path)


@pytest.mark.slow
def test_finetune_starts_from_the_checkpoint_and_saves_back(pretrained, tmp_path, capsys):
    assert isinstance(pretrained.tokenizer, HFTokenizer)  # the byte tokenizer, as tokenizer.json
    objective = LMObjective(
        model=pretrained.model,
        seq_len=16,
        init_params=pretrained.params,
        tokenizer=pretrained.tokenizer,
    )
    row = np.asarray(pretrained.tokenizer.encode("dew trains jax models. " * 2)[:17], np.int32)
    batch = {"text": np.tile(row, (8, 1))}
    data = Dataset(train=lambda partition: itertools.repeat(batch), val=None, records=8, batch=8)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))

    start = trainer.init_state()
    for got, want in zip(jax.tree.leaves(start.params), jax.tree.leaves(pretrained.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    loss_before = float(
        objective.loss({"params": {"policy": pretrained.params}}, batch, None)[0].value
    )
    state = trainer.fit(data, steps=12, log_every=1)
    logged = [
        float(line.split("loss ")[1].split(",")[0])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("step ") and "loss" in line
    ]
    assert logged[0] == pytest.approx(loss_before, rel=1e-4)  # step 1 scored the checkpoint
    loss_after = float(objective.loss({"params": state.params_by_role}, batch, None)[0])
    assert loss_after < 0.7 * loss_before  # it trained

    pipeline = objective.inference_task(state)
    assert isinstance(pipeline, TextGeneration)
    text = pipeline("dew trains", max_new_tokens=8)
    assert isinstance(text, str) and text.startswith("dew trains")
    path = pipeline.save(tmp_path / "tuned", format="llama")
    tuned = Pretrained.load(path)
    assert tuned.format == "llama" and tuned.model == pretrained.model
    for got, want in zip(jax.tree.leaves(tuned.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert tuned.pipeline()("dew trains", max_new_tokens=8) == text
