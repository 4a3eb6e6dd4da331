"""Training speed on one GPU: Dew's ``Trainer.fit`` against a plain linen GPT-2 in a
hand-written jitted loop and against eager PyTorch (and ``torch.compile``) on the
same network, each side in its own process, one table of ratios.

The network is the GPT-2 block of tools/bench_model.py (LayerNorm, GELU, learned
positions, q/k/v/out and MLP with biases, untied head) at a GPU size. Every side
computes in bfloat16 with float32 master weights and adamw(3e-4) state in float32:

- ``dew``: ``CausalTransformer`` configured as that network (``norm='layer'``,
  ``mlp_activation='gelu'``, ``position_embedding='learned'``, ``use_bias=True``,
  ``dtype=bfloat16``), ``LMObjective``, ``Trainer.fit`` with its default log off;
- ``hand``: the plain linen GPT-2 (``dtype=bfloat16``) in a jitted step with
  donation, ``optax.adamw``, the same random token rows;
- ``torch``: the same network in eager PyTorch, ``torch.autocast(bfloat16)``,
  ``scaled_dot_product_attention(is_causal=True)``, ``AdamW(fused=True)``;
- ``torch_compile``: the same model under ``torch.compile``.

Tokens/s over steps 2..N (after the first, compiling step), each side's median of
``--repeats`` runs; ratios are Dew's tokens/s over the side's. No GPU: the script
still runs (``--size tiny`` on the CPU is its smoke test), and says so.

    python tools/bench_gpu.py                       # size gpu (~350M-class), 30 steps
    python tools/bench_gpu.py --size tiny --steps 4 --sides dew hand torch
    python tools/bench_gpu.py --side dew --size gpu # one side, prints RESULT {json}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

SIZES = {
    "tiny": dict(emb=64, layers=2, heads=4, mlp=256, seq=64, batch=4, vocab=512),
    # GPT-2 medium's width and heads at half its depth, a 32k vocabulary
    "gpu": dict(emb=1024, layers=12, heads=16, mlp=4096, seq=1024, batch=16, vocab=32000),
    "gpu_large": dict(emb=2048, layers=16, heads=16, mlp=8192, seq=2048, batch=8, vocab=32000),
}
SIDES = ("dew", "hand", "torch", "torch_compile")


def rows(s):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, s["vocab"], (4, s["batch"], s["seq"] + 1)).astype(np.int32)


def flops_per_step(s) -> float:
    """6 N T for the matmuls plus causal attention's 6 L T^2 E (PaLM's appendix B)."""
    e, layers, mlp, seq, vocab = s["emb"], s["layers"], s["mlp"], s["seq"], s["vocab"]
    params = layers * (4 * e * e + 2 * e * mlp) + e * vocab
    tokens = s["batch"] * seq
    return 6 * params * tokens + 6 * layers * s["batch"] * seq * seq * e


def run_dew(s, steps):
    import itertools

    import jax
    import jax.numpy as jnp
    import optax

    from dew import Dataset, Trainer, models
    from dew.objectives.language.lm import LMObjective

    model = models.build(
        "causal_transformer", vocab_size=s["vocab"], emb_features=s["emb"],
        num_layers=s["layers"], num_heads=s["heads"], mlp_features=s["mlp"],
        max_seq_len=s["seq"], norm="layer", mlp_activation="gelu",
        position_embedding="learned", use_bias=True, dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
    )  # fmt: skip
    data_rows = rows(s)
    data = Dataset(
        train=lambda p: ({"text": r} for r in itertools.cycle(data_rows)),
        val=None, records=4 * s["batch"], batch=s["batch"],
    )  # fmt: skip
    trainer = Trainer(LMObjective(model=model, seq_len=s["seq"]), optax.adamw(3e-4),
                      key=jax.random.key(0), progress=False)  # fmt: skip
    marks = {}

    def clock(info):
        if info.step == 1:
            jax.block_until_ready(info.state.params)
            marks["t"] = time.perf_counter()

    trainer.add_hook(clock, name="bench clock")
    state = trainer.fit(data, steps=steps, log_every=0)
    jax.block_until_ready(state.params)
    return (time.perf_counter() - marks["t"]) / (steps - 1), jax.devices()[0].device_kind


def run_hand(s, steps):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    bf16 = jnp.bfloat16

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, e = x.shape
            h, d = s["heads"], e // s["heads"]
            y = nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x)
            q, k, v = (nn.Dense(e, dtype=bf16)(y).reshape(b, t, h, d) for _ in range(3))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, e)
            x = x + nn.Dense(e, dtype=bf16)(out)
            y = nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x)
            y = nn.Dense(s["mlp"], dtype=bf16)(y)
            return x + nn.Dense(e, dtype=bf16)(nn.gelu(y, approximate=True))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(s["vocab"], s["emb"], dtype=bf16)(tokens)
            pos = self.param("pos", nn.initializers.normal(0.02), (s["seq"], s["emb"]))
            x = x + pos[: tokens.shape[1]].astype(bf16)
            for _ in range(s["layers"]):
                x = Block()(x)
            x = nn.LayerNorm(epsilon=1e-6, dtype=bf16)(x)
            return nn.Dense(s["vocab"], use_bias=False, dtype=bf16)(x)

    model, optimizer = GPT(), optax.adamw(3e-4)
    params = model.init(jax.random.key(0), jnp.zeros((1, s["seq"]), jnp.int32))["params"]
    opt_state = optimizer.init(params)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    batches = [jnp.asarray(r) for r in rows(s)]
    params, opt_state, loss = step(params, opt_state, batches[0])
    jax.block_until_ready(loss)
    begin = time.perf_counter()
    for i in range(1, steps):
        params, opt_state, loss = step(params, opt_state, batches[i % 4])
    jax.block_until_ready((params, loss))
    assert np.isfinite(float(loss))
    return (time.perf_counter() - begin) / (steps - 1), jax.devices()[0].device_kind


def run_torch(s, steps, compiled):
    import torch
    from torch import nn

    device = "cuda" if torch.cuda.is_available() else "cpu"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            e, m = s["emb"], s["mlp"]
            self.n1, self.n2 = nn.LayerNorm(e, eps=1e-6), nn.LayerNorm(e, eps=1e-6)
            self.q, self.k, self.v, self.o = (nn.Linear(e, e) for _ in range(4))
            self.up, self.down = nn.Linear(e, m), nn.Linear(m, e)

        def forward(self, x):
            b, t, e = x.shape
            h = self.n1(x)
            q, k, v = (f(h).view(b, t, s["heads"], -1).transpose(1, 2)
                       for f in (self.q, self.k, self.v))  # fmt: skip
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(out.transpose(1, 2).reshape(b, t, e))
            return x + self.down(nn.functional.gelu(self.up(self.n2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(s["vocab"], s["emb"])
            self.pos = nn.Parameter(torch.randn(s["seq"], s["emb"]) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(s["layers"]))
            self.norm = nn.LayerNorm(s["emb"], eps=1e-6)
            self.head = nn.Linear(s["emb"], s["vocab"], bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.pos[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = GPT().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    forward = torch.compile(model) if compiled else model
    batches = [torch.as_tensor(r).long().to(device) for r in rows(s)]

    def step(tokens):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = forward(tokens[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, s["vocab"]), tokens[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step(batches[0])
    sync()
    begin = time.perf_counter()
    for i in range(1, steps):
        loss = step(batches[i % 4])
    sync()
    assert math.isfinite(float(loss.detach()))
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return (time.perf_counter() - begin) / (steps - 1), kind


def one_side(side, size, steps):
    s = SIZES[size]
    if side == "dew":
        seconds, kind = run_dew(s, steps)
    elif side == "hand":
        seconds, kind = run_hand(s, steps)
    else:
        seconds, kind = run_torch(s, steps, compiled=side == "torch_compile")
    tokens = s["batch"] * s["seq"]
    print("RESULT " + json.dumps(dict(side=side, size=size, step_s=seconds,
                                      tokens_per_s=tokens / seconds,
                                      tflops=flops_per_step(s) / seconds / 1e12,
                                      device=kind)), flush=True)  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--side", choices=SIDES, help="run one side in this process")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per side run")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (step 1 compiles), got {args.steps}")
    if args.side:
        return one_side(args.side, args.size, args.steps)
    results = {side: [] for side in args.sides}
    for repeat in range(args.repeats):
        for side in args.sides[repeat % len(args.sides) :] + args.sides[: repeat % len(args.sides)]:
            cmd = [sys.executable, __file__, "--side", side, "--size", args.size,
                   "--steps", str(args.steps)]  # fmt: skip
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                     env=os.environ)  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"{side}: timed out after {args.timeout:.0f} s", flush=True)
                continue
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"{side}: failed (rc={out.returncode}): {out.stderr[-1500:]}", flush=True)
                continue
            result = json.loads(line[-1][len("RESULT ") :])
            results[side].append(result)
            print(f"{side} #{repeat}: {result['tokens_per_s']:,.0f} tokens/s, "
                  f"{result['tflops']:.1f} TFLOP/s ({result['device']})", flush=True)  # fmt: skip
    s = SIZES[args.size]
    print(f"\nsize {args.size} {s}; {flops_per_step(s) / 1e12:.2f} TFLOP a step (6NT + attention)")
    dew = [r["tokens_per_s"] for r in results.get("dew", [])]
    print("| side | tokens/s (median) | TFLOP/s | Dew / side |")
    print("|---|---|---|---|")
    for side, rs in results.items():
        if not rs:
            print(f"| {side} | failed | | |")
            continue
        rate = statistics.median(r["tokens_per_s"] for r in rs)
        tflops = statistics.median(r["tflops"] for r in rs)
        ratio = f"{statistics.median(dew) / rate:.2f}" if dew else "n/a"
        print(f"| {side} | {rate:,.0f} | {tflops:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
