"""A mixture-of-experts feed-forward block with top-k routing and a load-balancing loss.

Each token picks ``experts_per_token`` of ``num_experts`` SwiGLU/GELU experts by
its router probabilities ``p = softmax(x W_router)`` (Shazeer et al., 2017;
GShard, Lepikhin et al., 2020; Switch, Fedus et al., 2021; Mixtral):

    y_t = sum_{e in topk(p_t)} g_te expert_e(x_t),   g_te = p_te / sum_{e' in topk(p_t)} p_te'

(with one expert per token the gate is ``p_te`` itself, as in Switch).

Routing policy: dropless dense dispatch. Every expert runs on every token and
the outputs are combined with the (mostly zero) gates, so no token is ever
dropped and the result does not depend on how the batch is split over
devices. It costs ``num_experts / experts_per_token`` times the expert
FLOPs of a capacity-limited dispatch: the right trade for small models and
tests, not for large sparse ones.

Load balance (Switch/GShard): with ``f_e`` the fraction of the batch's
(token, choice) assignments that go to expert ``e`` and ``P_e`` the mean
router probability of ``e`` over the batch's tokens,

    aux_loss = num_experts * sum_e f_e P_e

which is 1 for a perfectly uniform router and ``num_experts`` when one
expert takes everything. It is taken per sequence (row), as DeepSeek-V3's
sequence-wise balance loss, and sown into the ``intermediates`` collection
as ``aux_loss`` of shape ``[batch]``: a per-row value averages exactly over
microbatches and devices (a batch-wide ``f_e P_e`` is a product of means, which
no split of the batch reproduces). :class:`dew.objectives.lm.LMObjective` adds
its mean over rows and layers to the loss (:func:`collect_aux_losses`).

Expert weights carry the logical axis ``expert`` first (``[expert, embed,
mlp]``), so the trainer's rules split them over the ``expert`` mesh axis;
the per-expert activations ``[expert, batch, length, mlp]`` follow them.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.mlp import ACTIVATIONS


def load_balancing_loss(probs: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
    """``num_experts * sum_e f_e P_e`` over all tokens (a scalar).

    probs: router probabilities ``[..., expert]``.
    chosen: the chosen experts' ids ``[..., experts_per_token]``.
    """
    probs = probs.reshape(-1, num_experts)
    assigned = jax.nn.one_hot(chosen.reshape(-1), num_experts, dtype=jnp.float32)
    fraction = jnp.mean(assigned, axis=0)  # f_e, [expert]
    mean_prob = jnp.mean(probs.astype(jnp.float32), axis=0)  # P_e, [expert]
    return num_experts * jnp.sum(fraction * mean_prob)


def row_load_balancing_loss(probs: jax.Array, chosen: jax.Array, num_experts: int) -> jax.Array:
    """:func:`load_balancing_loss` of each row (sequence) on its own: ``[batch]``.

    probs: ``[batch, length, expert]``; chosen: ``[batch, length, experts_per_token]``.
    """
    return jax.vmap(lambda p, c: load_balancing_loss(p, c, num_experts))(probs, chosen)


def collect_aux_losses(intermediates, rows: int) -> jax.Array | None:
    """The mean over layers of every sown ``aux_loss``, per row: ``[rows]``, or
    None when the model sowed none. Scanned layers sow ``[layers, rows]``,
    unscanned ones ``[rows]`` each; a scalar (a pipelined stack's mean) counts
    the same for every row."""
    leaves = [
        v
        for path, v in jax.tree_util.tree_leaves_with_path(intermediates)
        if any(getattr(k, "key", None) == "aux_loss" for k in path)
    ]
    if not leaves:
        return None
    per_row = [
        jnp.broadcast_to(v.astype(jnp.float32), (1, rows))
        if v.ndim == 0
        else v.astype(jnp.float32).reshape(-1, rows)
        for v in leaves
    ]
    return jnp.mean(jnp.concatenate(per_row, axis=0), axis=0)


class MoE(nn.Module):
    """Top-k routed experts, each a feed-forward block of width ``features``.

    num_experts: experts in the layer.
    experts_per_token: experts each token is sent to (k).
    features: hidden width of each expert.
    activation: as in :class:`dew.nn.MLP` ('swiglu', 'gelu', 'gelu_exact', 'relu').
    init_std: standard deviation of the normal weight initialiser.
    """

    num_experts: int
    experts_per_token: int
    features: int
    activation: str = "swiglu"
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def _param(self, name, shape, names):
        return self.param(
            name,
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), names),
            shape,
            self.param_dtype,
        ).astype(self.dtype)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [batch, length, embed] -> [batch, length, embed]``; sows ``aux_loss [batch]``."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; use one of {ACTIVATIONS}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be between 1 and "
                f"num_experts {self.num_experts}"
            )
        embed, num, k = x.shape[-1], self.num_experts, self.experts_per_token
        x = x.astype(self.dtype)
        router = self._param("router", (embed, num), (axes.EMBED, axes.EXPERT))
        # Routing in float32: near-ties must not flip with the compute dtype.
        logits = jnp.einsum("ble,ex->blx", x.astype(jnp.float32), router.astype(jnp.float32))
        probs = jax.nn.softmax(logits, axis=-1)  # [batch, length, expert]
        top_probs, chosen = jax.lax.top_k(probs, k)  # [batch, length, k]
        if k > 1:
            top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        one_hot = jax.nn.one_hot(chosen, num, dtype=jnp.float32)  # [batch, length, k, expert]
        gates = jnp.sum(one_hot * top_probs[..., None], axis=-2)  # [batch, length, expert]
        self.sow("intermediates", "aux_loss", row_load_balancing_loss(probs, chosen, num))

        hidden_axes = (axes.EXPERT, axes.BATCH, axes.LENGTH, axes.MLP)
        up = jnp.einsum(
            "ble,xem->xblm",
            x,
            self._param("up", (num, embed, self.features), (axes.EXPERT, axes.EMBED, axes.MLP)),
        )
        up = nn.with_logical_constraint(up, hidden_axes)  # [expert, batch, length, mlp]
        if self.activation == "swiglu":
            gate = jnp.einsum(
                "ble,xem->xblm",
                x,
                self._param(
                    "gate", (num, embed, self.features), (axes.EXPERT, axes.EMBED, axes.MLP)
                ),
            )
            hidden = nn.silu(nn.with_logical_constraint(gate, hidden_axes)) * up
        elif self.activation == "gelu":
            hidden = nn.gelu(up, approximate=True)
        elif self.activation == "gelu_exact":
            hidden = nn.gelu(up, approximate=False)
        else:
            hidden = nn.relu(up)
        down = self._param("down", (num, self.features, embed), (axes.EXPERT, axes.MLP, axes.EMBED))
        out = jnp.einsum("xblm,xme->xble", hidden, down)  # [expert, batch, length, embed]
        out = nn.with_logical_constraint(out, (axes.EXPERT, axes.BATCH, axes.LENGTH, axes.EMBED))
        return jnp.einsum("xble,blx->ble", out, gates.astype(self.dtype))  # [batch, length, embed]
