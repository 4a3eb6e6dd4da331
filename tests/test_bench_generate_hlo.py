"""tools/bench_generate.py's loop-body count: it reads the decode step, the largest
while-loop body of a compiled program, and counts what the step adds (one tiny
compile, well under a second)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def bench(load_tool):
    return load_tool("bench_generate.py")


def body_size(bench, step_fn):
    def run(x):
        return jax.lax.fori_loop(0, 16, lambda i, x: step_fn(x, i), x)

    return bench.loop_body_size(jax.jit(run).lower(jnp.ones((8, 32))).compile().as_text())


def test_a_longer_step_counts_more(bench):
    small = body_size(bench, lambda x, i: jnp.tanh(x @ x.T) @ x)
    large = body_size(bench, lambda x, i: jnp.tanh(jnp.sin(x @ x.T) @ x) @ x.T @ x + i)
    assert 0 < small[0] < large[0]
    assert 0 <= small[1] <= small[0] and 0 <= large[1] <= large[0]


def test_no_loop_counts_nothing(bench):
    hlo = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
    assert bench.loop_body_size(hlo) == (0, 0)
