"""Supervised fine-tuning on chat data end to end: a tokenizer_config.json's chat
template, packed SFTExamples, LMObjective and the Trainer. One sgd step at
accumulate 1 and 2 equals a hand-written full-batch step on the global mean over
the assistant tokens, although the two microbatches hold different token counts
(a mean of per-microbatch means would differ). Tolerance 1e-6 relative (float32
sums in another order); parameters also 1e-6 of each array's largest entry."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import HFTokenizer, Partition, SFTExamples
from dew.data.testing import write_chat_tokenizer
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM
from dew.objectives.lm import LMObjective
from dew.train import MeshSpec, Trainer

SEQ, ROWS, LR = 95, 4, 1.0
CONFIG = {**TINY_LM, "vocab_size": 304, "max_seq_len": SEQ}
KEYS = dict(loss_mask_key="loss_mask", segment_ids_key="segment_ids", positions_key="positions")
ONE_DEVICE = MeshSpec(data=1, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft")
    tokenizer = HFTokenizer(write_chat_tokenizer(folder / "tokenizer"))
    with open(folder / "chats.jsonl", "w") as f:
        for i in range(10):
            answer = "four. " * (1 + 3 * (i % 4))
            messages = [
                {"role": "user", "content": "what is two plus two?" + "?" * i},
                {"role": "assistant", "content": answer.strip()},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    reader = SFTExamples(folder / "chats.jsonl", seq_len=SEQ, tokenizer=tokenizer, packing=True)
    return reader.load(batch=ROWS)


def reference(batch):
    """One full-batch sgd step written by hand on the masked token mean."""
    model = CausalTransformer(**CONFIG)
    objective = LMObjective(model, seq_len=SEQ, **KEYS)
    k_init, _ = jax.random.split(jax.random.key(0))
    params = nn.unbox(jax.jit(objective.init)(k_init))["params"]

    def loss(p):
        cut = {k: v[:, :-1] for k, v in batch.items()}
        logits = model.apply(
            {"params": p}, cut["text"], segment_ids=cut["segment_ids"], positions=cut["positions"]
        )
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["text"][:, 1:])
        w = batch["loss_mask"][:, 1:].astype(jnp.float32)
        return jnp.sum(nll * w) / jnp.sum(w), nll

    (value, nll), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return float(value), new, np.asarray(nll, np.float64)


@pytest.mark.slow
def test_sft_accumulates_exactly(data, tmp_path):
    batch = next(data.train(Partition()))  # the trainer's first batch
    w = batch["loss_mask"][:, 1:]
    tokens = w.sum(1)
    want_loss, want, nll = reference(batch)
    # the two microbatches weigh differently: a mean of their means is another number
    means = [(nll[half] * w[half]).sum() / w[half].sum() for half in (slice(0, 2), slice(2, 4))]
    assert abs(np.mean(means) - want_loss) > 1e-5 * want_loss
    for accumulate in (1, 2):
        run_dir = tmp_path / f"accumulate{accumulate}"
        trainer = Trainer(
            LMObjective(CausalTransformer(**CONFIG), **KEYS),
            optax.sgd(LR),
            key=jax.random.key(0),
            mesh=ONE_DEVICE,
            accumulate=accumulate,
            run_dir=str(run_dir),
            progress=False,
        )
        state = trainer.fit(data, steps=1, log_every=1)
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        record = next(r for r in records if r["kind"] == "train")
        assert record["loss"] == pytest.approx(want_loss, rel=1e-6)
        assert record["tokens"] == tokens.sum()
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max()),
            jax.device_get(state.params),
            want,
        )
