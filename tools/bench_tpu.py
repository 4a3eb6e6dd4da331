"""Dew's ``Trainer.fit`` against plain linen loops on one accelerator chip, each side in
its own process, side by side in one run.

Sides (``--side``):
  hand    a plain linen GPT-2 (or Llama) with ``jax.nn.dot_product_attention``: one
          jitted step with donated state (what a user writes first);
  splash  the same plain loop with the Pallas splash-attention kernel (what the chip
          can do with a fused attention);
  dew     the same network as ``models.build("causal_transformer", ...)`` through
          ``Trainer.fit`` with its defaults (``attention_kernel='auto'``: splash on a
          TPU), ``--remat`` naming a remat policy on every side that has one (with
          ``none``, Dew's default: ``"minimal"`` for the scanned stack on a TPU);
  dew_loop (suites only) the same with ``--stack loop`` (``use_scan=False``).

bf16 compute, float32 master weights and AdamW state (``--param-dtype bfloat16`` for
bf16 weights and state); tokens/s over steps 2..N; MFU as MaxText counts it (the
model's matmul FLOPs 6 N T with the LM head, causal attention 6 L B T^2 E: half of
the full 12, no remat recomputation) against the chip's bf16 peak; the compiled
step's temporaries (``memory_analysis()``; Dew's through ``dew.train.plan``, the
program ``fit`` runs) and the peak HBM in use.

    python tools/bench_tpu.py --suite table      # the issue's table + seq 4096
    python tools/bench_tpu.py --suite llama      # Dew's default Llama-style backbone
    python tools/bench_tpu.py --side dew --batch 8 --seq 1024 [--remat full]

On a TPU host without a package index: ``source ../shared/tpu/host_env.sh`` first
(docs/performance.md, "On a TPU v5e chip"). Prints one ``RESULT {json}`` line a run
and, for a suite, a markdown table of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

GPT2 = dict(emb=1024, layers=12, heads=16, kv_heads=16, mlp=4096, vocab=32000, model="gpt2")
# Dew's default backbone (RMSNorm, SwiGLU, RoPE, GQA) at about 0.5B parameters
LLAMA = dict(emb=1536, layers=16, heads=12, kv_heads=4, mlp=4096, vocab=32000, model="llama")

PEAKS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6": 918e12,
         "TPU v4": 275e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # fmt: skip


def model_flops(s: dict) -> float:
    """MaxText's training FLOPs of one step: 6 x (matmul parameters, the LM head
    included, not the embedding lookup) x tokens + causal attention 6 L B T^2 E
    (QK^T and PV, 2 B T^2 E each forward, halved by the causal mask, x3 for the
    backward)."""
    e, layers, t, b = s["emb"], s["layers"], s["seq"], s["batch"]
    hd = e // s["heads"]
    attn = e * hd * (2 * s["heads"] + 2 * s["kv_heads"])
    mlp = (3 if s["model"] == "llama" else 2) * e * s["mlp"]
    params = layers * (attn + mlp) + e * s["vocab"]
    return 6 * params * b * t + 6 * layers * b * t * t * e


def peak_flops() -> float:
    import jax

    kind = jax.devices()[0].device_kind
    for name in sorted(PEAKS, key=len, reverse=True):
        if name.lower() in kind.lower():
            return PEAKS[name]
    return float("nan")


def rows(s: dict):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, s["vocab"], (4, s["batch"], s["seq"] + 1)).astype(np.int32)


def peak_hbm() -> float:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30


def run_dew(
    s: dict,
    steps: int,
    remat: str,
    kernel: str,
    param_dtype: str,
    stack: str = "default",
    with_plan: bool = True,
):
    import itertools

    import jax
    import jax.numpy as jnp
    import optax

    from dew import Dataset, Trainer, models
    from dew.objectives.language.lm import LMObjective
    from dew.train import MeshSpec
    from dew.train.plan import plan

    style = (
        dict(norm="layer", mlp_activation="gelu", position_embedding="learned", use_bias=True)
        if s["model"] == "gpt2"
        else dict(num_kv_heads=s["kv_heads"])
    )
    model = models.build(
        "causal_transformer", vocab_size=s["vocab"], emb_features=s["emb"],
        num_layers=s["layers"], num_heads=s["heads"], mlp_features=s["mlp"],
        max_seq_len=s["seq"], dtype=jnp.bfloat16, param_dtype=jnp.dtype(param_dtype),
        attention_kernel=kernel, remat_policy={"none": None, "off": "none"}.get(remat, remat),
        use_scan=stack != "loop",
        unroll_layers={"scan": False, "straight": True}.get(stack), **style,
    )  # fmt: skip
    objective = LMObjective(model=model, seq_len=s["seq"])
    optimizer = optax.adamw(3e-4)
    planned = None
    started = time.perf_counter()
    if with_plan:
        planned = plan(objective, optimizer, mesh=MeshSpec(),
                       batch={"text": ((s["batch"], s["seq"] + 1), jnp.int32)})  # fmt: skip
    r = rows(s)
    data = Dataset(train=lambda p: ({"text": x} for x in itertools.cycle(r)), val=None,
                   records=4 * s["batch"], batch=s["batch"])  # fmt: skip
    trainer = Trainer(objective, optimizer, key=jax.random.key(0), progress=False)
    marks = {"plan_s": time.perf_counter() - started}

    def clock(info):
        if info.step == 1:
            jax.block_until_ready(info.state.params)
            marks["t"] = time.perf_counter()
            marks["first_step_s"] = marks["t"] - started

    trainer.add_hook(clock, name="bench clock")
    started = time.perf_counter()
    state = trainer.fit(data, steps=steps, log_every=0)
    jax.block_until_ready(state.params)
    seconds = (time.perf_counter() - marks["t"]) / (steps - 1)
    times = {k: marks[k] for k in ("plan_s", "first_step_s")}
    if planned is None:
        return seconds, float("nan"), float("nan"), times
    return seconds, planned.temporary_bytes, planned.peak_bytes, times


def run_hand(s: dict, steps: int, remat: str, splash: bool, param_dtype: str):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    bf16 = jnp.bfloat16
    h, kvh, d, t = s["heads"], s["kv_heads"], s["emb"] // s["heads"], s["seq"]
    if splash:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_mask as sm,
        )

        mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(h)])
        bs = min(512, t)
        blocks = sk.BlockSizes(block_q=bs, block_kv_compute=bs, block_kv=bs, block_q_dkv=bs,
                               block_kv_dkv=bs, block_kv_dkv_compute=bs, block_q_dq=bs,
                               block_kv_dq=bs)  # fmt: skip
        kernel = sk.make_splash_mha(mask=mask, head_shards=1, q_seq_shards=1, block_sizes=blocks)

        def attn(q, k, v):  # [b, t, h, d]
            q = q * (d**-0.5)
            o = jax.vmap(kernel)(*(a.transpose(0, 2, 1, 3) for a in (q, k, v)))
            return o.transpose(0, 2, 1, 3)
    else:

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    gpt2 = s["model"] == "gpt2"

    def norm():
        return nn.LayerNorm(epsilon=1e-6, dtype=bf16) if gpt2 else nn.RMSNorm(dtype=bf16)

    def rope(x):  # [b, t, heads, d]
        if gpt2:
            return x
        freq = 1.0 / (10000 ** (jnp.arange(0, d, 2) / d))
        angle = jnp.arange(t)[:, None] * freq[None]  # [t, d/2]
        cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(bf16)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t_, e = x.shape
            dense = lambda n: nn.Dense(n, dtype=bf16, use_bias=gpt2)  # noqa: E731
            y = norm()(x)
            q = rope(dense(h * d)(y).reshape(b, t_, h, d))
            k = rope(dense(kvh * d)(y).reshape(b, t_, kvh, d))
            v = dense(kvh * d)(y).reshape(b, t_, kvh, d)
            x = x + dense(e)(attn(q, k, v).reshape(b, t_, e))
            y = norm()(x)
            if gpt2:
                return x + dense(e)(nn.gelu(dense(s["mlp"])(y), approximate=True))
            return x + dense(e)(nn.silu(dense(s["mlp"])(y)) * dense(s["mlp"])(y))

    policies = {"none": None, "full": jax.checkpoint_policies.nothing_saveable,
                "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}  # fmt: skip
    layer = nn.remat(Block, policy=policies[remat]) if remat != "none" else Block

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(s["vocab"], s["emb"], dtype=bf16)(tokens)
            if gpt2:
                pos = self.param("pos", nn.initializers.normal(0.02), (t, s["emb"]))
                x = x + pos[: tokens.shape[1]].astype(bf16)
            for _ in range(s["layers"]):
                x = layer()(x)
            x = norm()(x)
            return nn.Dense(s["vocab"], use_bias=False, dtype=bf16)(x)

    model, opt = LM(), optax.adamw(3e-4)
    params = model.init(jax.random.key(0), jnp.zeros((1, t), jnp.int32))["params"]
    params = jax.tree.map(lambda a: a.astype(param_dtype), params)
    ost = opt.init(params)

    def loss_fn(p, tok):
        logits = model.apply({"params": p}, tok[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    def step(p, o, tok):
        loss, g = jax.value_and_grad(loss_fn)(p, tok)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    batches = [jnp.asarray(x) for x in rows(s)]
    step = jax.jit(step, donate_argnums=(0, 1))
    compiled = step.lower(params, ost, batches[0]).compile()
    memory = compiled.memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes)  # fmt: skip
    params, ost, loss = compiled(params, ost, batches[0])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for i in range(1, steps):
        params, ost, loss = compiled(params, ost, batches[i % 4])
    jax.block_until_ready((params, loss))
    assert np.isfinite(float(loss))
    return (time.perf_counter() - start) / (steps - 1), memory.temp_size_in_bytes, peak


def one(a) -> dict:
    s = dict(GPT2 if a.model == "gpt2" else LLAMA, seq=a.seq, batch=a.batch)
    for key in ("emb", "layers", "heads", "kv_heads", "mlp"):
        if getattr(a, key) is not None:
            s[key] = getattr(a, key)
    res = dict(
        side=a.side, remat=a.remat, kernel=a.kernel, param_dtype=a.param_dtype, stack=a.stack, **s
    )
    try:
        if a.side == "dew":
            sec, temp, peak, times = run_dew(
                s, a.steps, a.remat, a.kernel, a.param_dtype, a.stack, not a.no_plan
            )
            res.update(times)
        else:
            sec, temp, peak = run_hand(s, a.steps, a.remat, a.side == "splash", a.param_dtype)
        res.update(step_s=sec, tokens_per_s=s["batch"] * s["seq"] / sec,
                   mfu=model_flops(s) / sec / peak_flops(), temp_gib=temp / 2**30,
                   compiled_peak_gib=peak / 2**30, peak_hbm_gib=peak_hbm())  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a side that runs out of memory is a result
        text = str(e)
        need = re.search(r"(?:Used|needs?|allocate)\s*([\d.]+\s*[GM]i?B?)", text)
        res["error"] = ("out of memory" if "RESOURCE_EXHAUSTED" in text or "memory" in
                        text.lower() else type(e).__name__) + (f" ({need.group(0)})" if need
                                                               else "")  # fmt: skip
        res["error_text"] = text[-600:]
    return res


# (label, seq, batch, remat, sides): the table and seq 4096
TABLE = [
    ("seq 1024, batch 4", 1024, 4, "none", ("hand", "splash", "dew", "dew_loop")),
    ("seq 1024, batch 8", 1024, 8, "none", ("hand", "splash", "dew", "dew_loop")),
    ("seq 1024, batch 16", 1024, 16, "none", ("hand", "splash", "dew", "dew_loop")),
    ("seq 1024, batch 8, remat full", 1024, 8, "full", ("splash", "dew", "dew_loop")),
    ("seq 1024, batch 16, remat full", 1024, 16, "full", ("hand", "splash", "dew", "dew_loop")),
    ("seq 2048, batch 4, remat full", 2048, 4, "full", ("splash", "dew", "dew_loop")),
    ("seq 2048, batch 4", 2048, 4, "none", ("hand", "splash", "dew", "dew_loop")),
    ("seq 4096, batch 2", 4096, 2, "none", ("hand", "splash", "dew", "dew_loop")),
    ("seq 4096, batch 4, remat full", 4096, 4, "full", ("splash", "dew", "dew_loop")),
]
SUITES = {
    "table": [("gpt2", *row) for row in TABLE],
    "quick": [("gpt2", *TABLE[1])],
    "llama": [
        ("llama", "Llama-style seq 2048, batch 4", 2048, 4, "none", ("dew",)),
        ("llama", "Llama-style seq 2048, batch 4, remat minimal", 2048, 4, "minimal", ("dew",)),
        ("llama", "Llama-style seq 2048, batch 8, remat full", 2048, 8, "full", ("dew",)),
    ],
}


def suite(name: str, steps: int, out: str | None, only: set[str] | None) -> None:
    results = []
    for model, label, seq, batch, remat, sides in SUITES[name]:
        for side in sides:
            if only and side not in only:
                continue
            cmd = [sys.executable, __file__, "--side", side.split("_")[0], "--model", model,
                   "--seq", str(seq), "--batch", str(batch), "--remat", remat, "--steps",
                   str(steps)]  # fmt: skip
            if side == "dew_loop":  # Dew's model as a loop of blocks (use_scan=False)
                cmd += ["--stack", "loop", "--no-plan"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # killed at a time limit: end the running side too, so the chip is free
            signal.signal(signal.SIGTERM, lambda *_, proc=proc: (proc.kill(), sys.exit(143)))
            stdout, stderr = proc.communicate()
            line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else dict(side=side, error=stderr[-800:])
            res["label"], res["side"] = label, side
            results.append(res)
            print("RESULT " + json.dumps(res), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(res) + "\n")
    print_table(results)


def print_table(results: list[dict]) -> None:
    def cell(r):
        if r is None:
            return ""
        if "error" in r:
            return r["error"]
        return (f"{r['tokens_per_s'] / 1e3:.1f}k ({100 * r['mfu']:.1f}%), temp "
                f"{r['temp_gib']:.2f} GiB")  # fmt: skip

    print("\n| setting | hand (XLA attention) | splash | Dew fit | Dew / splash | Dew / hand | "
          "Dew fit, use_scan=False | its / splash |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        by = {r["side"]: r for r in results if r["label"] == label}
        ratio = lambda a, b, by=by: (  # noqa: E731
            f"{by[a]['tokens_per_s'] / by[b]['tokens_per_s']:.3f}"
            if a in by and b in by and "error" not in by[a] and "error" not in by[b]
            else ""
        )
        print(
            f"| {label} | {cell(by.get('hand'))} | {cell(by.get('splash'))} | "
            f"{cell(by.get('dew'))} | {ratio('dew', 'splash')} | {ratio('dew', 'hand')} | "
            f"{cell(by.get('dew_loop'))} | {ratio('dew_loop', 'splash')} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES))
    p.add_argument("--only", help="comma-separated sides of a suite to run")
    p.add_argument("--out", help="append each RESULT's json to this file")
    p.add_argument("--side", choices=["dew", "hand", "splash"])
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    for key in ("emb", "layers", "heads", "kv_heads", "mlp"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, dest=key)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--remat", default="none", help="none, full or minimal (Dew: any name; "
                   "none = Dew's default, off = remat_policy='none')")  # fmt: skip
    p.add_argument("--kernel", default="auto", help="Dew's attention_kernel")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument(
        "--stack",
        choices=["default", "scan", "straight", "loop"],
        default="default",
        help="Dew's layer stack: its default (one compiled loop), the scanned "
        "[layers, ...] parameters run as one compiled loop or straight (a compile of "
        "minutes), or a loop of layer_{i} blocks",
    )
    p.add_argument("--no-plan", action="store_true", help="Dew: skip plan's compile")
    a = p.parse_args()
    if a.suite:
        suite(a.suite, a.steps, a.out, set(a.only.split(",")) if a.only else None)
        return
    if not a.side:
        p.error("give --suite or --side")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax-bench-cache")
    print("RESULT " + json.dumps(one(a)), flush=True)


if __name__ == "__main__":
    main()
