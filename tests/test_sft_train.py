"""Supervised fine-tuning on chat data end to end: a tokenizer_config.json's chat
template, packed SFTExamples, LMObjective and the Trainer. The loss of packed chat
rows is the mean NLL over the assistant turns' tokens of each conversation run alone
(numpy float64; the turns found from a hand-written ChatML). One sgd step at
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
from dew.objectives import Step
from dew.objectives.language.lm import LMObjective
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
    objective = LMObjective(model=model, seq_len=SEQ, **KEYS)
    k_init, _ = jax.random.split(jax.random.key(0))
    params = nn.unbox(jax.jit(objective.init)(k_init))["params"]["policy"]

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
            LMObjective(model=CausalTransformer(**CONFIG), **KEYS),
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


CHATS = [
    [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "two plus two?"},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "and one more?"},
        {"role": "assistant", "content": "five."},
    ],
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "how are you?"}, {"role": "assistant", "content": "fine."}],
]


def chatml(messages):
    """ChatML written by hand, and the character span of each assistant turn's content
    and its end of turn (``four.<|im_end|>\\n``): the text SFT trains on."""
    text, spans = "", []
    for m in messages:
        head, body = f"<|im_start|>{m['role']}\n", f"{m['content']}<|im_end|>\n"
        if m["role"] == "assistant":
            spans.append((len(text) + len(head), len(text) + len(head) + len(body)))
        text += head + body
    return text, spans


def test_chat_loss_is_the_mean_nll_over_the_assistant_tokens(tmp_path):
    """Packed rows of ``messages`` conversations (several in a row): LMObjective's loss
    counts exactly the assistant turns' tokens and is their mean NLL, each conversation
    run alone, right-padded (float64 numpy; 1e-5 relative: float32 logits)."""
    tokenizer = HFTokenizer(write_chat_tokenizer(tmp_path / "tokenizer"))
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in CHATS)
    reader = SFTExamples(
        tmp_path / "chats.jsonl", seq_len=SEQ, tokenizer=tokenizer, packing=True, read_threads=0
    )
    batch = next(reader.load(batch=2).train(Partition()))
    segments = batch["segment_ids"]
    assert segments.max() > 1 and sum(len(np.unique(r[r > 0])) for r in segments) == len(CHATS)
    model = CausalTransformer(**CONFIG)
    objective = LMObjective(model=model, seq_len=SEQ, **KEYS)
    variables = nn.unbox(jax.jit(objective.init)(jax.random.key(0)))
    step = Step(index=jnp.int32(0), key=jax.random.key(0))
    loss, _ = jax.jit(objective.loss)(variables, batch, step)

    rows = np.full((len(CHATS), SEQ), tokenizer.pad_id, np.int32)
    examples = []
    for row, messages in zip(rows, CHATS, strict=True):
        text, spans = chatml(messages)
        ids, offsets = tokenizer.encode_with_offsets(text)
        trained = [any(a <= lo and hi <= b for a, b in spans) for lo, hi in offsets]
        assert tokenizer.decode(
            [i for i, t in zip(ids, trained, strict=True) if t], skip_special_tokens=False
        ) == "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
        row[: len(ids)] = ids
        examples.append((np.asarray(ids), np.asarray(trained)))
    logits = jax.jit(model.apply)({"params": variables["params"]["policy"]}, rows)
    total, count = 0.0, 0
    for r, (ids, trained) in enumerate(examples):
        z = np.asarray(logits[r, : len(ids) - 1], np.float64)  # predicts ids[1:]
        nll = np.logaddexp.reduce(z, -1) - np.take_along_axis(z, ids[1:, None], -1)[:, 0]
        total, count = total + nll[trained[1:]].sum(), count + trained[1:].sum()
    assert float(loss.weight) == count
    assert float(loss.value) == pytest.approx(total / count, rel=1e-5)
