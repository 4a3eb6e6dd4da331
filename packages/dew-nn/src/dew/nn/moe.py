"""A mixture-of-experts feed-forward block with top-k routing and a load-balancing loss.

Each token picks ``experts_per_token`` of ``num_experts`` SwiGLU/GELU experts by
its router probabilities ``p = softmax(x W_router)`` (Shazeer et al., 2017;
GShard, Lepikhin et al., 2020; Switch, Fedus et al., 2021; Mixtral):

    y_t = sum_{e in topk(p_t)} g_te expert_e(x_t),   g_te = p_te / sum_{e' in topk(p_t)} p_te'

(with one expert per token the gate is ``p_te`` itself, as in Switch).

Dispatch (``dispatch=``), all over one weight layout ``[expert, embed, mlp]``:

- ``'dense'`` (the default and the reference): every expert runs on every token
  and the outputs are combined with the (mostly zero) gates. It costs
  ``num_experts / experts_per_token`` times the expert FLOPs of a routed layer.
- ``'capacity'``: each expert's tokens are gathered into ``[expert, capacity,
  embed]`` buckets and run as one batched matmul (fast on every backend).
- ``'ragged'``: the (token, choice) assignments are sorted by expert and run
  through grouped matmuls, ``jax.lax.ragged_dot`` (a grouped kernel on GPU/TPU;
  XLA:CPU lowers it to a dense masked product, ~10x one matmul at 8 experts).
- ``'blocked'``: dropless grouped matmuls in plain XLA: the assignments sorted by
  expert, each expert's group padded to whole blocks, one batched matmul over the
  blocks (at most ``tokens * k / block + num_experts`` blocks, whatever the load).
- ``'auto'``: ``'ragged'`` on GPU/TPU; elsewhere ``'capacity'`` with a capacity
  factor and ``'blocked'`` without.

``capacity_factor=None`` is dropless: the buckets hold ``tokens`` rows, enough
for any load (on the capacity path that costs as much as dense; set a factor
for speed). A factor ``c`` gives each expert ``ceil(c * tokens * k /
num_experts)`` slots and drops the assignments past them in the order of
:mod:`dew.nn._moe_dispatch` (choice first, then token); every dispatch drops the
same ones. The dropped fraction of each row's ``length * k`` assignments is
sown as ``dropped_fraction [batch]`` (:class:`dew.objectives.language.lm.LMObjective`
logs its mean over rows and layers as ``moe_dropped_fraction``).

Under a mesh whose ``expert`` logical axis is split (``MeshSpec(expert=E)``),
the routed dispatches run in ``jax.shard_map``, all of them as capacity buckets
there: each device routes its own tokens, sends each expert's bucket to the
device that holds that expert with ``jax.lax.all_to_all`` and receives the
results back in the original order (capacity per device; dropless when
``capacity_factor`` is None). The batch must be split over the ``expert`` mesh
axis too (the default rules do); the experts' ``mlp`` may be split over
``tensor`` (partial sums are ``psum``-ed) and their ``embed`` over ``fsdp``
(gathered on entry). A batch that does not split over the mesh (initialisation
on one example) is routed unsplit, in one program the compiler partitions.

Load balance (Switch/GShard): with ``f_e`` the fraction of the batch's
(token, choice) assignments that go to expert ``e`` and ``P_e`` the mean
router probability of ``e`` over the batch's tokens,

    aux_loss = num_experts * sum_e f_e P_e

which is 1 for a perfectly uniform router and ``num_experts`` when one
expert takes everything. It is taken per sequence (row), as DeepSeek-V3's
sequence-wise balance loss, and sown into the ``intermediates`` collection
as ``aux_loss`` of shape ``[batch]``: a per-row value averages exactly over
microbatches and devices (a batch-wide ``f_e P_e`` is a product of means, which
no split of the batch reproduces). :class:`dew.objectives.language.lm.LMObjective` adds
its mean over rows and layers to the loss (:func:`collect_sown`).

Expert weights carry the logical axis ``expert`` first (``[expert, embed,
mlp]``), so the trainer's rules split them over the ``expert`` mesh axis;
the per-expert activations ``[expert, batch, length, mlp]`` follow them.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import _moe_dispatch as dispatches
from dew.nn import axes
from dew.nn.mlp import MLP, activate, check_activation, is_gated
from dew.nn.shards import check_divides, mesh_axes_of


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


def collect_sown(intermediates, name: str, rows: int) -> jax.Array | None:
    """The mean over layers of every sown ``name`` (``aux_loss``, ``z_loss``,
    ``dropped_fraction``), per row: ``[rows]``, or None when the model sowed
    none (decided at trace time). Scanned layers sow ``[layers, rows]``,
    unscanned ones ``[rows]`` each; a scalar (a pipelined stack's mean) counts
    the same for every row."""
    leaves = [
        v
        for path, v in jax.tree_util.tree_leaves_with_path(intermediates)
        if any(getattr(k, "key", None) == name for k in path)
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

    num_experts: experts in the layer (many small ones = DeepSeek-MoE's
      fine-grained experts: raise ``num_experts`` and ``experts_per_token``,
      lower ``features``).
    experts_per_token: experts each token is sent to (k).
    features: hidden width of each expert.
    activation: as in :class:`dew.nn.MLP` ('swiglu', 'gelu', 'gelu_exact', 'relu').
    init_std: standard deviation of the normal weight initialiser.
    dispatch: 'dense' (reference), 'capacity', 'blocked', 'ragged' or 'auto'
      (module docstring).
    capacity_factor: None = dropless; a number > 0 = slots per expert as
      ``ceil(capacity_factor * tokens * k / num_experts)``, the rest dropped.
    gating: 'softmax_topk' (softmax over all experts, then the k largest) or
      'topk_softmax' (the k largest logits, then their softmax: Mixtral).
    norm_topk_prob: renormalise the k ``softmax_topk`` weights to sum 1 (True:
      Mixtral, Qwen3-MoE; False: Qwen2-MoE, DeepSeek-MoE); None = when k > 1.
    shared_features: width of a shared expert every token goes through
      (Qwen2-MoE, DeepSeek-MoE); 0 = none.
    shared_expert_gate: scale the shared expert by ``sigmoid(x w)``, a learned
      per-token gate (Qwen2-MoE); False adds it ungated (DeepSeek-MoE).
    router_z_loss_weight: the router z-loss (ST-MoE, Zoph et al. 2022),
      ``mean_t logsumexp(logits_t)^2`` per row, is added to the sown
      ``aux_loss`` with this weight relative to the balance loss; 0 = not
      trained on. It is sown on its own as ``z_loss`` whatever the weight
      (:class:`dew.objectives.language.lm.LMObjective` logs it as ``moe_z_loss``). With
      ``LMObjective(aux_loss_weight=0.01)``, 0.1 here gives ST-MoE's 1e-3.

    The router (logits, softmax, top-k, losses, the shared gate) runs in float32
    whatever ``dtype`` is.
    """

    num_experts: int
    experts_per_token: int
    features: int
    activation: str = "swiglu"
    init_std: float = 0.02
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    dispatch: str = "dense"
    capacity_factor: float | None = None
    gating: str = "softmax_topk"
    norm_topk_prob: bool | None = None
    shared_features: int = 0
    shared_expert_gate: bool = True
    router_z_loss_weight: float = 0.0

    def _param(self, name, shape, names):
        return self.param(
            name,
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), names),
            shape,
            self.param_dtype,
        ).astype(self.dtype)

    def _check(self):
        check_activation(self.activation)
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be between 1 and "
                f"num_experts {self.num_experts}"
            )
        if self.dispatch not in dispatches.DISPATCHES:
            raise ValueError(
                f"unknown MoE dispatch {self.dispatch!r}; use one of {dispatches.DISPATCHES}"
            )
        if self.gating not in dispatches.GATINGS:
            raise ValueError(f"unknown MoE gating {self.gating!r}; use one of {dispatches.GATINGS}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor must be > 0 (or None for dropless), got {self.capacity_factor}"
            )
        if self.shared_features < 0 or self.router_z_loss_weight < 0:
            raise ValueError(
                f"shared_features ({self.shared_features}) and router_z_loss_weight "
                f"({self.router_z_loss_weight}) must be >= 0"
            )

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [batch, length, embed] -> [batch, length, embed]``; sows ``aux_loss
        [batch]``, ``z_loss [batch]`` and, with a capacity factor,
        ``dropped_fraction [batch]``."""
        self._check()
        check_divides(self.num_experts, axes.EXPERT, "MoE num_experts")
        batch, length, embed = x.shape
        num, k = self.num_experts, self.experts_per_token
        x = x.astype(self.dtype)
        router = self._param("router", (embed, num), (axes.EMBED, axes.EXPERT))
        # Routing in float32: near-ties must not flip with the compute dtype.
        logits = jnp.einsum("ble,ex->blx", x.astype(jnp.float32), router.astype(jnp.float32))
        probs, weights, chosen = dispatches.route(logits, k, self.gating, self.norm_topk_prob)
        aux = row_load_balancing_loss(probs, chosen, num)
        # sown whatever its weight: growing router logits show in the logs before
        # they hurt, whether or not the z-loss is trained on
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)), axis=-1)  # [batch]
        self.sow("intermediates", "z_loss", z)
        if self.router_z_loss_weight:
            aux = aux + self.router_z_loss_weight * z
        self.sow("intermediates", "aux_loss", aux)

        weight_axes = (axes.EXPERT, axes.EMBED, axes.MLP)
        up = self._param("up", (num, embed, self.features), weight_axes)
        gate = None
        if is_gated(self.activation):
            gate = self._param("gate", (num, embed, self.features), weight_axes)
        down = self._param("down", (num, self.features, embed), (axes.EXPERT, axes.MLP, axes.EMBED))

        how = dispatches.resolve(self.dispatch, self.capacity_factor)
        if how == "dense":
            out, kept = self._dense(x, weights, chosen, gate, up, down)
        else:
            out, kept = self._routed(how, x, weights, chosen, gate, up, down)
        if self.capacity_factor is not None:
            # per row, as aux_loss: every row routes length * k assignments, so the
            # mean over rows (and microbatches, devices) is the batch's dropped share
            dropped = 1 - jnp.mean(kept.astype(jnp.float32), axis=(1, 2))  # [batch]
            self.sow("intermediates", "dropped_fraction", dropped)
        if self.shared_features:
            out = out + self._shared(x)
        return out

    def _shared(self, x):
        shared = MLP(
            features=self.shared_features,
            activation=self.activation,
            init_std=self.init_std,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="shared_expert",
        )(x)
        if not self.shared_expert_gate:
            return shared
        w = self.param(
            "shared_expert_gate",
            nn.with_logical_partitioning(nn.initializers.normal(self.init_std), (axes.EMBED, None)),
            (x.shape[-1], 1),
            self.param_dtype,
        )
        g = jax.nn.sigmoid(jnp.einsum("ble,eo->blo", x.astype(jnp.float32), w.astype(jnp.float32)))
        return shared * g.astype(self.dtype)

    def _kept(self, chosen, tokens):
        """Which assignments fit their expert's capacity (all when dropless)."""
        if self.capacity_factor is None:
            return jnp.ones(chosen.shape, bool)
        flat = chosen.reshape(-1, chosen.shape[-1])
        capacity = dispatches.capacity_of(
            tokens, self.experts_per_token, self.num_experts, self.capacity_factor
        )
        return (dispatches.positions(flat, self.num_experts) < capacity).reshape(chosen.shape)

    def _dense(self, x, weights, chosen, gate, up, down):
        num = self.num_experts
        kept = self._kept(chosen, x.shape[0] * x.shape[1])
        if self.capacity_factor is not None:
            weights = weights * kept
        one_hot = jax.nn.one_hot(chosen, num, dtype=jnp.float32)  # [batch, length, k, expert]
        gates = jnp.sum(one_hot * weights[..., None], axis=-2)  # [batch, length, expert]
        hidden_axes = (axes.EXPERT, axes.BATCH, axes.LENGTH, axes.MLP)
        upped = nn.with_logical_constraint(jnp.einsum("ble,xem->xblm", x, up), hidden_axes)
        gated = None
        if is_gated(self.activation):
            gated = jnp.einsum("ble,xem->xblm", x, gate)
            gated = nn.with_logical_constraint(gated, hidden_axes)
        hidden = activate(self.activation, upped, gated)
        out = jnp.einsum("xblm,xme->xble", hidden, down)  # [expert, batch, length, embed]
        out = nn.with_logical_constraint(out, (axes.EXPERT, axes.BATCH, axes.LENGTH, axes.EMBED))
        out = jnp.einsum("xble,blx->ble", out, gates.astype(self.dtype))
        return out, kept

    def _routed(self, how, x, weights, chosen, gate, up, down):
        """The capacity or ragged dispatch, on this device's tokens (in
        ``shard_map`` under a mesh that splits the batch or the experts)."""
        batch, length, embed = x.shape
        k, num, activation = self.experts_per_token, self.num_experts, self.activation
        mesh = jax.sharding.get_abstract_mesh()

        def split(logical):  # the mesh axes of more than one device that split `logical`
            return tuple(a for a in mesh_axes_of(logical) if mesh.shape[a] > 1)

        batch_axes, length_axes = split(axes.BATCH), split(axes.LENGTH)
        expert_axes, tensor_axes = split(axes.EXPERT), split(axes.MLP)
        missing = [a for a in expert_axes if a not in batch_axes]
        if missing:
            raise ValueError(
                f"MoE dispatch {how!r} under an expert mesh axis needs the batch split over it "
                f"too (the batch is split over {batch_axes}, the experts over {expert_axes}); "
                "map logical 'batch' to the expert mesh axis in the rules (as DEFAULT_RULES "
                "does) or use dispatch='dense'"
            )
        check_divides(self.features, axes.MLP, "MoE features")
        ways = lambda names: math.prod(int(mesh.shape[a]) for a in names)  # noqa: E731
        if batch % ways(batch_axes) or length % ways(length_axes):
            # a batch that does not split (the trainer's initialisation on one example):
            # all tokens routed in one program, which the compiler partitions (GSPMD)
            batch_axes = length_axes = expert_axes = tensor_axes = ()
        sharded = bool(batch_axes or length_axes or tensor_axes)

        def local(x, weights, chosen, params):
            gate, up, down = params.get("gate"), params["up"], params["down"]
            b, n, _ = x.shape
            tokens = b * n
            rows, w, c = (
                x.reshape(tokens, embed),
                weights.reshape(tokens, k),
                chosen.reshape(tokens, k),
            )
            capacity = dispatches.capacity_of(tokens, k, num, self.capacity_factor)
            if expert_axes:
                out, kept = dispatches.expert_parallel(
                    rows,
                    c,
                    w,
                    gate,
                    up,
                    down,
                    activation=activation,
                    capacity=capacity,
                    expert_axes=expert_axes,
                    tensor_axes=tensor_axes,
                )
                return out.reshape(b, n, embed), kept.reshape(b, n, k)
            routed = {
                "ragged": dispatches.ragged_dispatch,
                "blocked": dispatches.blocked_dispatch,
                "capacity": dispatches.capacity_dispatch,
            }[how]
            out, kept = routed(rows, c, w, gate, up, down, activation, capacity)
            if tensor_axes:
                out = jax.lax.psum(out, tensor_axes)
            return out.reshape(b, n, embed), kept.reshape(b, n, k)

        params = {"up": up, "down": down} | ({} if gate is None else {"gate": gate})
        if not sharded and not expert_axes:
            return local(x, weights, chosen, params)
        P = jax.sharding.PartitionSpec
        tokens = P(batch_axes or None, length_axes or None, None)
        experts = P(expert_axes or None, None, tensor_axes or None)
        downs = P(expert_axes or None, tensor_axes or None, None)
        mapped = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(
                tokens,
                tokens,
                tokens,
                {n: downs if n == "down" else experts for n in params},
            ),
            out_specs=(tokens, tokens),
        )
        return mapped(x, weights, chosen, params)
