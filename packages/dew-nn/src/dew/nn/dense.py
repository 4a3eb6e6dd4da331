"""Dense contractions over token rows: activations ``[batch, length, ...]`` flattened
to ``[batch * length, ...]`` before a kernel contracts their feature axes.

The values are those of the contraction over the unflattened activations (the
same products and sums, in the same order); only the program XLA compiles
differs. The gradient of a kernel ``W`` in ``y = x W`` is ``dW = x^T dy``, a
contraction over every token axis of ``x`` and ``dy``. With two token axes
(``batch``, ``length``) XLA:CPU lays ``dy`` out again, a transposing copy of
the whole activation gradient, before the product; with one (``batch *
length``) it reads both operands as they are. On the medium LM (width 256,
SwiGLU 1024, 4096 tokens a step) those copies were about a fifth of the
training step's time (tools/bench_llama.py, docs/performance.md).
"""

from __future__ import annotations

import jax


def token_rows(x: jax.Array, feature_axes: int = 1) -> jax.Array:
    """``x [batch, length, *features]`` (any number of leading token axes) as
    ``[tokens, *features]``, keeping the last ``feature_axes`` axes; a reshape,
    which XLA compiles to no copy for row-major arrays."""
    features = x.shape[x.ndim - feature_axes :]
    return x.reshape(-1, *features)
