"""Causal self-attention, forward and backward, on this CPU: Dew's one product over
every key (``dew.nn.attention.attend``), Dew's query blocks
(``attend_in_query_blocks``, the CPU default from 128 tokens) and eager torch's
``scaled_dot_product_attention(is_causal=True)`` (2 intra-op threads), at equal
tokens per call (``batch * length`` = ``--tokens``), 8 heads of 32.

Each side runs in its own process, alternating over ``--rounds``; a figure is the
best of 5 x 3 calls of ``sum(attention(q, k, v) * w)``'s gradient with respect to
q, k and v, in process CPU milliseconds (every thread). Ratios are one product /
blocks and torch / blocks (above 1: the blocks are faster).

    python tools/bench_attention.py --lengths 128 256 512 1024 --rounds 2
    python tools/bench_attention.py --torch-python /tmp/torchenv/bin/python

``--step BLOCKS...`` times the whole training step instead: tools/bench_model.py's
GPT-2-style ``dew_gpt2`` at ``--size`` (hand-written jitted step, adamw, donation)
compiled once per block count (``one`` = one product, ``auto`` = Dew's default, or a
number of query blocks), all in one process, the timed runs alternating; ratios
are one product / this, paired per round.

    python tools/bench_attention.py --step one auto 3 4 --size medium --rounds 4

torch comes from its own venv (``python -m venv /tmp/torchenv &&
/tmp/torchenv/bin/pip install torch==2.13.0 numpy``); a missing one is reported
as "not installed".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HEADS, HEAD_DIM = 8, 32
SIDES = ("one", "blocks", "torch")


def child(side: str, batch: int, length: int) -> float:
    import time

    import _timing  # tools/, this script's directory
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v, w = (rng.standard_normal((batch, length, HEADS, HEAD_DIM), dtype=np.float32)
                  for _ in range(4))  # fmt: skip
    if side == "torch":
        import torch

        torch.set_num_threads(2)
        # torch's layout [batch, heads, length, head_dim]
        q, k, v, w = (torch.from_numpy(x).transpose(1, 2).contiguous() for x in (q, k, v, w))
        for x in (q, k, v):
            x.requires_grad_()

        def call():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return torch.autograd.grad((out * w).sum(), (q, k, v))

        def ready(out):
            return out
    else:
        import jax
        import jax.numpy as jnp

        from dew.nn import attention, masks

        slots = np.arange(length)
        visible = masks.attention_mask(masks.causal(), slots[None], slots[None],
                                       np.ones((1, length), bool), slots, slots)  # fmt: skip
        block = attention.causal_query_block(length) or 64

        def attend(q, k, v):
            if side == "blocks":
                return attention.attend_in_query_blocks(q, k, v, visible, block)
            return attention.attend(q, k, v, visible)

        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), argnums=(0, 1, 2)))
        q, k, v = (jnp.asarray(x) for x in (q, k, v))

        def call():
            return grads(q, k, v)

        def ready(out):
            return jax.block_until_ready(out)

    best = _timing.best_of(call, ready, warm=2, repeats=5, calls=3, clock=time.process_time)
    return best * 1e3


def run(python: str, side: str, batch: int, length: int) -> float | str:
    if not os.path.exists(python):
        return f"not installed (no {python})"
    args = [python, __file__, "--child", side, "--batch", str(batch), "--lengths", str(length)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    if "No module named 'torch'" in done.stderr:
        return f"not installed (no torch in {python})"
    return f"failed (rc {done.returncode}): {done.stderr.strip()[-200:]}"


def block_rule(setting: str):
    """``causal_query_block`` for a ``--step`` setting: ``one``, ``auto`` or a count."""
    from dew.nn import attention

    if setting == "auto":
        return attention.causal_query_block
    if setting == "one":
        return lambda length: None
    count = int(setting)
    return lambda length: -(-length // count) if length >= attention.CAUSAL_BLOCKS_FROM else None


def time_steps(settings: list[str], size: str, rounds: int) -> None:
    """The ``--step`` table: bench_model's ``dew_gpt2`` compiled under each setting."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import time

    import bench_model

    from dew.nn import attention

    default, entries, compile_s = attention.causal_query_block, {}, {}
    try:
        for setting in settings:
            attention.causal_query_block = block_rule(setting)
            begin = time.perf_counter()
            entries[setting] = list(bench_model.build("dew_gpt2", size))
            compile_s[setting] = time.perf_counter() - begin
            bench_model.timed(entries[setting], 1)  # warm
    finally:
        attention.causal_query_block = default
    steps = 3 if size == "medium" else 40
    times: dict[str, list] = {s: [] for s in settings}
    for r in range(rounds):
        for setting in settings[r % len(settings) :] + settings[: r % len(settings)]:
            times[setting].append(bench_model.timed(entries[setting], steps))
    base = times[settings[0]]
    print(f"dew_gpt2 {size}, {steps} steps x {rounds} rounds; load {os.getloadavg()}")
    print("| setting | wall ms/step | CPU ms/step | first / this wall | first / this CPU | "
          "build + compile s |\n|---|---|---|---|---|---|")  # fmt: skip
    for setting in settings:
        t = times[setting]
        wall = statistics.median(a[0] / b[0] for a, b in zip(base, t, strict=True))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(base, t, strict=True))
        print(f"| {setting} | {statistics.median(x[0] for x in t) * 1e3:.0f} | "
              f"{statistics.median(x[1] for x in t) * 1e3:.0f} | {wall:.3f} | {cpu:.3f} | "
              f"{compile_s[setting]:.1f} |")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--tokens", type=int, default=4096, help="batch * length per call")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--torch-python", default="/tmp/torchenv/bin/python")
    parser.add_argument("--step", nargs="+", metavar="BLOCKS", help="one, auto or a count")
    parser.add_argument("--size", default="medium", help="--step only: seed or medium")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for length in args.lengths:
        if length < 1 or (args.child is None and args.tokens % length):
            parser.error(
                f"--lengths {length}: each length must be >= 1 and divide --tokens "
                f"{args.tokens} (the batch is tokens / length)"
            )
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    for setting in args.step or ():
        if setting not in ("one", "auto") and not (setting.isdigit() and int(setting) >= 1):
            parser.error(f"--step {setting!r}: use 'one', 'auto' or a block count >= 1")
    if args.size not in ("seed", "medium"):
        parser.error(f"--size {args.size!r}: use one of ['seed', 'medium']")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        result = child(args.child, args.batch, args.lengths[0])
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.step:
        time_steps(args.step, args.size, args.rounds)
        return
    from dew.nn import attention

    here = sys.executable
    pythons = {"one": here, "blocks": here, "torch": args.torch_python}
    print(
        f"causal attention forward + backward, {HEADS} heads of {HEAD_DIM}, {args.tokens} "
        f"tokens a call; CPU ms, best of 5 x 3; load {os.getloadavg()}"
    )
    print("| length | batch | block | one product ms | blocks ms | torch ms | one / blocks "
          "| torch / blocks |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for length in args.lengths:
        batch = args.tokens // length
        times: dict[str, list] = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in SIDES[r % 3 :] + SIDES[: r % 3]:
                times[side].append(run(pythons[side], side, batch, length))
        ok = {s: [t for t in ts if isinstance(t, float)] for s, ts in times.items()}
        shown = {s: f"{statistics.median(ok[s]):.1f}" if ok[s] else str(times[s][0])
                 for s in SIDES}  # fmt: skip
        ratio = {s: f"{statistics.median(ok[s]) / statistics.median(ok['blocks']):.2f}x"
                 if ok[s] and ok["blocks"] else "" for s in ("one", "torch")}  # fmt: skip
        block = attention.causal_query_block(length) or "(64, forced)"
        print(f"| {length} | {batch} | {block} | {shown['one']} | {shown['blocks']} | "
              f"{shown['torch']} | {ratio['one']} | {ratio['torch']} |", flush=True)  # fmt: skip
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
