"""Eager PyTorch side of the peer suite: the GPT-2-style network of
tools/bench_model.py (LayerNorm, GELU, learned positions, q/k/v/out and MLP
with biases, untied head), adamw, random token rows, ``--threads`` intra-op
threads; greedy generation with transformers' ``GPT2LMHeadModel.generate``
(KV cache) of the same width and depth. Install (a venv of its own):
``python -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch==2.13.0
transformers numpy``.

    /tmp/torchenv/bin/python tools/bench_peers/torch_gpt2.py --size medium --steps 10

Prints one line ``RESULT {json}`` (tools/bench_peers/protocol.py).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import protocol  # noqa: E402

SIZES, VOCAB = protocol.SIZES, protocol.VOCAB


class Block(nn.Module):
    def __init__(self, emb, heads, mlp):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(emb, eps=1e-6), nn.LayerNorm(emb, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(emb, emb) for _ in range(4))
        self.up, self.down = nn.Linear(emb, mlp), nn.Linear(mlp, emb)

    def forward(self, x):
        b, t, e = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, t, self.heads, e // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))  # fmt: skip
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(out.transpose(1, 2).reshape(b, t, e))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, emb, layers, heads, mlp, seq):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, emb)
        self.pos = nn.Parameter(torch.randn(seq, emb) * 0.02)
        self.blocks = nn.ModuleList(Block(emb, heads, mlp) for _ in range(layers))
        self.norm = nn.LayerNorm(emb, eps=1e-6)
        self.head = nn.Linear(emb, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    protocol.check_size(args.size)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    s = SIZES[args.size]
    model = GPT(s["emb"], s["layers"], s["heads"], s["mlp"], s["seq"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    rows = torch.as_tensor(protocol.rows(args.size)).long()

    def step(tokens):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    loss = step(rows[0])
    first = time.perf_counter() - START
    clock = protocol.Clock()
    for i in range(1, args.steps):
        loss = step(rows[i % 4])
    wall, cpu = clock.per(args.steps - 1)
    assert math.isfinite(float(loss.detach()))
    protocol.emit("torch", protocol.result(args.size, first, wall, cpu, generation(s)))


def generation(s) -> float:
    """transformers' cached greedy ``generate`` on a GPT-2 of the same shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=s["seq"], n_embd=s["emb"],
                        n_layer=s["layers"], n_head=s["heads"], n_inner=s["mlp"],
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = GPT2LMHeadModel(config).eval()
    ids = torch.as_tensor(protocol.prompts("")).long()

    def call():
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=protocol.NEW_TOKENS,
                               min_new_tokens=protocol.NEW_TOKENS, pad_token_id=0)  # fmt: skip

    return protocol.warm_generation(call)


if __name__ == "__main__":
    main()
