"""Splash attention against Dew's XLA attention on the chip: every mask kind of
``dew.nn.testing.attention_kernel_cases``, in float32 (matmuls at 'highest'
precision) and bfloat16 compute; prints the largest difference of the output (rows
that are not padding) and the relative one of the input and parameter gradients.

    python tools/check_tpu_attention.py [--length 1024] [--block 64]

The same comparison runs in CI on the CPU with the kernel in Pallas interpret mode
(packages/dew-nn/tests/test_fused_attention.py).
"""

import argparse
import json

import jax
import jax.numpy as jnp

from dew.nn.testing import attention_kernel_cases, compare_attention_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--block", type=int, default=64, help="block diffusion's block size")
    p.add_argument("--kernel", default="splash")
    a = p.parse_args()
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    print("| mask | dtype | output | input grad (rel.) | param grad (rel.) |")
    print("|---|---|---|---|---|")
    for name, attention, call in attention_kernel_cases(a.length, a.block):
        for dtype in (jnp.float32, jnp.bfloat16):
            with jax.default_matmul_precision("highest" if dtype == jnp.float32 else "default"):
                d = compare_attention_kernels(attention, call, kernel=a.kernel,
                                              length=a.length, dtype=dtype)  # fmt: skip
            print(
                f"| {name} | {jnp.dtype(dtype).name} | {d['output']:.2e} | "
                f"{d['input_grad']:.2e} | {d['param_grad']:.2e} |",
                flush=True,
            )
            print("RESULT " + json.dumps(dict(mask=name, dtype=jnp.dtype(dtype).name, **d)))


if __name__ == "__main__":
    main()
