"""One float32 matrix product, XLA:CPU (jax, jitted ``x @ y``) against eager torch
(``torch.matmul``, 2 intra-op threads) on the same CPU: what bounds every
matmul-heavy comparison with torch in docs/performance.md (the medium LM, JEPA
feature extraction). Each side runs in its own process, alternating; the figure is
the best of ``--repeats`` x 10 calls, in GFLOP/s.

    python tools/bench_matmul.py --size 1024 --rounds 2
    python tools/bench_matmul.py --torch-python /tmp/torchenv/bin/python

torch comes from its own venv (``python -m venv /tmp/torchenv &&
/tmp/torchenv/bin/pip install torch==2.13.0 numpy``); a missing one is reported as
"not installed".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def child(side: str, n: int, repeats: int) -> None:
    import _timing  # tools/, this script's directory
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (rng.random((n, n), dtype=np.float32) for _ in range(2))
    if side == "torch":
        import torch

        torch.set_num_threads(2)
        x, y = torch.from_numpy(a), torch.from_numpy(b)

        def call():
            return torch.matmul(x, y)

        def ready(out):
            return out
    else:
        import jax
        import jax.numpy as jnp

        x, y = jnp.asarray(a), jnp.asarray(b)
        product = jax.jit(lambda p, q: p @ q)

        def call():
            return product(x, y)

        def ready(out):
            return out.block_until_ready()

    best = _timing.best_of(call, ready, warm=3, repeats=repeats, calls=10)
    print(f"RESULT {2 * n**3 / best / 1e9:.1f}")


def run(python: str, side: str, n: int, repeats: int) -> str:
    if not os.path.exists(python):
        return f"not installed (no {python})"
    args = [python, __file__, "--child", side, "--size", str(n), "--repeats", str(repeats)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return f"{line.split()[1]} GFLOP/s"
    return f"failed (rc {done.returncode}): {done.stderr.strip()[-160:]}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024, help="n of the n x n x n product")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--torch-python", default="/tmp/torchenv/bin/python")
    parser.add_argument("--child", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size < 1 or args.repeats < 1 or args.rounds < 1:
        parser.error(
            f"--size {args.size}, --repeats {args.repeats}, --rounds {args.rounds}: "
            f"each must be at least 1"
        )
    if args.child:
        return child(args.child, args.size, args.repeats)
    sides = {"jax": sys.executable, "torch": args.torch_python}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else list(sides)[::-1]:
            shown = run(sides[side], side, args.size, args.repeats)
            print(f"round {r + 1} {side}: {args.size}^3 float32 product, best {shown}", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
