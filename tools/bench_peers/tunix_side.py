"""Tunix side of the peer suite: Tunix's own Llama3 model (``tunix.models.llama3``,
flax nnx) at the suite's width and depth, trained by Tunix's ``PeftTrainer``
(its own jitted train step, optax adamw, full fine-tuning: no LoRA), greedy
generation by Tunix's ``Sampler`` (KV cache). Llama-style (RMSNorm, RoPE,
SwiGLU, no biases), so run.py compares it with the ``dew_llama`` side.

Install (outside the repository; Tunix needs Python >= 3.11; CPU jax):

    uv venv -p /root/.pyenv/versions/3.12.1/bin/python3 /work/peers/tunix
    VIRTUAL_ENV=/work/peers/tunix uv pip install google-tunix "jax[cpu]"

    /work/peers/tunix/bin/python tools/bench_peers/tunix_side.py --size seed

Rows are ``seq + 1`` tokens: Tunix's default loss predicts tokens 2..L of its
input, so ``seq`` targets per row as on every other side. Prints ``RESULT {json}``.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import protocol  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate import sampler as sampler_lib  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.sft import peft_trainer, utils  # noqa: E402


class IdTokenizer:
    """Token ids written as text (``"12 7 250"``): the Sampler takes strings."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(i) for i in ids)

    def bos_id(self):
        return 0  # falsy: no BOS is prepended

    def eos_id(self):
        return protocol.VOCAB + 1  # never produced: exactly NEW_TOKENS tokens

    def pad_id(self):
        return 0


def model_inputs(x):
    mask = x.input_mask
    return dict(
        input_tokens=x.input_tokens,
        input_mask=mask,
        positions=utils.build_positions_from_mask(mask),
        attention_mask=utils.make_causal_attn_mask(mask),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    protocol.check_size(args.size)
    s = protocol.SIZES[args.size]
    config = llama3.ModelConfig(
        num_layers=s["layers"], vocab_size=protocol.VOCAB, embed_dim=s["emb"],
        hidden_dim=s["mlp"], num_heads=s["heads"], head_dim=s["emb"] // s["heads"],
        num_kv_heads=s["heads"], rope_theta=10_000, norm_eps=1e-6,
    )  # fmt: skip
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto)
    rows = protocol.rows(args.size)
    batches = [
        peft_trainer.TrainingInput(input_tokens=r, input_mask=np.ones_like(r, bool)) for r in rows
    ]
    with jax.set_mesh(mesh):
        model = llama3.Llama3(config, rngs=nnx.Rngs(0))
        cfg = peft_trainer.TrainingConfig(
            eval_every_n_steps=10**9, max_steps=1, pbar_description=None
        )
        trainer = peft_trainer.PeftTrainer(model, optax.adamw(3e-3), cfg)
        trainer = trainer.with_gen_model_input_fn(model_inputs)
        trainer.train(batches * (args.steps + 1))
        jax.block_until_ready(nnx.state(model))
        first = time.perf_counter() - START
        trainer.config = dataclasses.replace(cfg, max_steps=args.steps)
        clock = protocol.Clock()
        trainer.train(batches * (args.steps + 1))
        jax.block_until_ready(nnx.state(model))
        wall, cpu = clock.per(args.steps - 1)
        cache = sampler_lib.CacheConfig(
            cache_size=protocol.PROMPT_TOKENS + protocol.NEW_TOKENS + 8,
            num_layers=s["layers"], num_kv_heads=s["heads"], head_dim=s["emb"] // s["heads"],
        )  # fmt: skip
        sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
        prompts = [" ".join(map(str, p)) for p in protocol.prompts(args.size)]

        def call():
            return sampler(prompts, max_generation_steps=protocol.NEW_TOKENS, temperature=0.0,
                           max_prompt_length=protocol.PROMPT_TOKENS, echo=False)  # fmt: skip

        rate = protocol.warm_generation(call)
    protocol.emit("tunix", protocol.result(args.size, first, wall, cpu, rate))


if __name__ == "__main__":
    main()
