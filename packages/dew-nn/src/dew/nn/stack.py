"""The layer stack: ``num_layers`` identical blocks, scanned, looped or pipelined.

Every backbone (decoder, encoder, DiT, ViT) runs its blocks through a
:class:`LayerStack`, which owns how they run and how their parameters are laid out:

- ``use_scan=True``: one ``nn.scan`` over the layers; each parameter gets a
  leading ``[layers, ...]`` axis named by the logical axis ``layers``
  (compiles once whatever the depth). Parameters live under ``name``
  (``layers/...``).
- ``use_scan=False``: a Python loop; parameters under ``{loop_name}_{i}``
  (``layer_0/...``, ``layer_1/...``).
- ``use_remat``: recompute each layer's activations in the backward pass
  (``jax.checkpoint``), saving what ``remat_policy`` names, if anything.
- ``num_stages > 1``: a GPipe pipeline (:mod:`dew.nn.pipeline`) over the
  scanned parameters, same tree and values, so a checkpoint moves between a
  pipelined and a plain stack.

A block is a Flax module class built as ``block(**block_kwargs)`` and called
as ``block(x, *args) -> x`` with ``x [batch, length, embed]``; ``args`` (positions,
padding, conditioning) are the same for every layer. Sown ``aux_loss``
intermediates come back as the plain stack sows them (``[layers, rows]`` under
``name`` when scanned); a pipelined stack sows their mean over layers as
``aux_loss`` of the calling module, and so ``z_loss`` and ``dropped_fraction``
(a mixture of experts' diagnostics, :data:`PIPELINED_SOWN`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn import axes
from dew.nn.keywords import check_keywords
from dew.nn.pipeline import check_pipeline, pipeline

# Named remat policies (MaxText's `remat_policy` names): what each layer keeps for the
# backward pass; the rest it recomputes. The names kept are those Dew's blocks give their
# activations with jax.ad_checkpoint.checkpoint_name: query_proj, key_proj, value_proj
# (the projections, before RoPE), context (the attention's output), out_proj, mlpwi (the
# MLP's up and gate projections) and mlpwo (its down projection); a decoder block's
# also attention_norm and mlp_norm (the norms' outputs), attention_residual (the residual
# stream between the attention and the MLP) and mlp_activation (the MLP's activation).
_PROJECTIONS = ("query_proj", "key_proj", "value_proj")
REMAT_POLICIES = {
    "none": "no recomputation: the backward pass reads every activation kept from the "
    "forward (fastest; most memory)",
    "full": "each layer's input only: the whole layer runs again in the backward pass "
    "(least memory; about 1/3 more compute)",
    "minimal": "every matrix product without batch dimensions (the q/k/v, output and MLP "
    "projections); norms, activations and attention are recomputed",
    "minimal_with_context": "as 'minimal', and the attention's output (context; with the "
    "splash kernel also its log-sum-exp), so the backward pass does not run the "
    "attention's forward again; norms and activations are recomputed",
    "save_matmul_inputs": "what every matrix product and the attention read: the norms' "
    "outputs, the q/k/v projections, the attention's output (with the splash kernel "
    "its log-sum-exp), the MLP's up/gate projections and its activation, and the "
    "residual between attention and MLP; the backward pass recomputes only norm "
    "statistics and elementwise steps outside the products (what XLA keeps for a loop "
    "of blocks without remat)",
    "save_dot_with_context_except_mlp": "q/k/v projections, the attention output "
    "(context) and its output projection; the MLP is recomputed",
    "save_dot_except_mlpwi": "q/k/v and output projections and the MLP's down projection; "
    "the MLP's up/gate projections are recomputed",
    "save_dot_except_mlp": "q/k/v and output projections; the attention and the MLP are recomputed",
    "save_qkv_proj": "the q/k/v projections only",
    "qkv_proj_offloaded": "the q/k/v projections, moved to host memory and back (a TPU or "
    "GPU backend)",
    "minimal_offloaded": "as 'minimal', moved to host memory and back (a TPU or GPU backend)",
}
"""Remat policy names -> what a layer keeps for the backward pass
(:class:`LayerStack`'s ``remat_policy``; docs/performance.md, "Memory")."""

_SAVED_NAMES = {
    "save_matmul_inputs": (
        *("attention_norm", *_PROJECTIONS, "context", "attention_residual"),
        *("mlp_norm", "mlpwi", "mlp_activation"),
    ),
    "save_dot_with_context_except_mlp": (*_PROJECTIONS, "context", "out_proj"),
    "save_dot_except_mlpwi": (*_PROJECTIONS, "out_proj", "mlpwo"),
    "save_dot_except_mlp": (*_PROJECTIONS, "out_proj"),
    "save_qkv_proj": _PROJECTIONS,
}


def remat_policy_fn(name: str | None) -> Callable | None:
    """The ``jax.checkpoint`` policy of a :data:`REMAT_POLICIES` name (or of a
    ``jax.checkpoint_policies`` attribute name); None for ``'full'`` / None (keep
    nothing)."""
    policies = jax.checkpoint_policies
    if name in (None, "full"):
        return None
    if name == "minimal":
        return policies.dots_with_no_batch_dims_saveable
    if name == "minimal_with_context":
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names("context")
        )
    if name in _SAVED_NAMES:
        return policies.save_only_these_names(*_SAVED_NAMES[name])
    if name == "qkv_proj_offloaded":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(_PROJECTIONS),
            offload_src="device",
            offload_dst="pinned_host",
        )
    if name == "minimal_offloaded":
        return policies.offload_dot_with_no_batch_dims(
            offload_src="device", offload_dst="pinned_host"
        )
    return getattr(policies, name)


def _backend() -> str:
    return jax.default_backend()


def default_remat_policy(compiled_loop: bool) -> str:
    """The remat policy of a stack that names none (``remat_policy=None``,
    ``use_remat=False``): ``'minimal'`` for layers scanned as one compiled loop on a
    TPU, ``'none'`` otherwise. On a TPU v5e chip the scan without remat writes every
    residual a layer's autodiff keeps (float32 norm statistics, the activations'
    intermediates) into stacked ``[layers, ...]`` buffers; keeping the projections
    alone and recomputing the rest in the backward pass is both faster and
    smaller there (docs/performance.md, "On a TPU v5e chip": the GPT-2's plain step
    122.6 -> 112.9 ms, temporaries 11.76 -> 4.91 GiB). A loop of blocks keeps no
    such buffers, and runs fastest without remat."""
    return "minimal" if compiled_loop and _backend() == "tpu" else "none"


# The collections a scanned block's variables stack along the layer axis.
SCANNED_COLLECTIONS = ("params", "cache", "intermediates")
# The per-row intermediates a pipelined stack hands back (a mixture of experts' loss
# and diagnostics); other sown values stay inside the pipeline.
PIPELINED_SOWN = ("aux_loss", "z_loss", "dropped_fraction")


@check_keywords
@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStack:
    """How ``num_layers`` blocks run.

    num_layers: blocks in the stack.
    use_scan: one scanned block with a leading ``layers`` parameter axis (fast
      compiles); False = a Python loop of ``num_layers`` named blocks.
    use_remat: recompute each block's activations in the backward pass, keeping
      what ``remat_policy`` names (None = ``'full'``: the block inputs only).
    remat_policy: what each block keeps for the backward pass: a name of
      :data:`REMAT_POLICIES` (MaxText's: ``'none'``, ``'full'``, ``'minimal'``,
      ``'save_dot_except_mlp'``, ``'save_qkv_proj'``, ...) or of a
      ``jax.checkpoint_policies`` policy (e.g. ``'dots_with_no_batch_dims_saveable'``).
      A name other than ``'none'`` turns remat on by itself; None = ``use_remat``
      decides (``'full'`` when True; when False, :func:`default_remat_policy`:
      ``'minimal'`` for a scanned stack on a TPU, ``'none'`` elsewhere).
    num_stages: pipeline stages (GPipe); 1 = no pipeline. Needs ``use_scan``
      and ``num_layers`` a multiple of it.
    num_microbatches: microbatches of the pipeline; None = ``num_stages``.
    num_repeats: rounds of the circular schedule (:mod:`dew.nn.pipeline`): each
      stage holds ``num_repeats`` chunks of layers and a microbatch goes round
      the stages that many times, for a bubble about ``num_repeats`` times
      smaller; 1 = GPipe.
    name: where the scanned parameters live (``layers/...``).
    loop_name: where looped block ``i``'s parameters live: ``{loop_name}_{i}``
      (``layer_0/...``); a scanned stack's ``[layers, ...]`` parameters sliced
      at ``i`` are block ``i``'s.
    unroll: with ``use_scan``, layers per iteration of the compiled loop
      (``nn.scan``'s ``unroll``): ``num_layers`` compiles a straight program over
      the same ``[layers, ...]`` parameters; 1 = one layer per iteration.
    straight: with ``use_scan``, run block ``i`` on slice ``i`` of the ``[layers,
      ...]`` parameters in a Python loop (one straight program, the same tree and
      values; the scan still creates the parameters and threads a decoding cache).
      On a TPU as fast as ``use_scan=False``, where a scan writes every layer's
      residuals and gradients into stacked buffers.
    """

    num_layers: int
    use_scan: bool = True
    use_remat: bool = False
    remat_policy: str | None = None
    num_stages: int = 1
    num_microbatches: int | None = None
    num_repeats: int = 1
    name: str = "layers"
    loop_name: str = "layer"
    unroll: int = 1
    straight: bool = False

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 1 <= self.unroll <= self.num_layers:
            raise ValueError(
                f"unroll {self.unroll} must be between 1 and num_layers {self.num_layers} "
                f"(layers per iteration of the scanned loop)"
            )
        policy = self.remat_policy
        if policy is not None and (
            not isinstance(policy, str)
            or (policy not in REMAT_POLICIES and not hasattr(jax.checkpoint_policies, policy))
        ):
            known = sorted(n for n in dir(jax.checkpoint_policies) if not n.startswith("_"))
            raise ValueError(
                f"unknown remat_policy {policy!r}; use None, one of {list(REMAT_POLICIES)} "
                f"or a jax.checkpoint_policies name ({', '.join(known)})"
            )
        if self.use_remat and policy == "none":
            raise ValueError(
                "use_remat=True with remat_policy='none' (no recomputation) contradict; "
                "drop use_remat, or name the policy to keep (e.g. 'full', 'minimal')"
            )
        if self.num_stages > 1 and not self.use_scan:
            raise ValueError(
                f"num_stages {self.num_stages} (a pipeline) needs use_scan=True: the pipeline "
                f"splits the scanned [layers, ...] parameters into stages"
            )
        check_pipeline(
            self.num_layers, self.num_stages, self.microbatches, self.microbatches, self.num_repeats
        )

    @property
    def microbatches(self) -> int:
        return self.num_microbatches or self.num_stages

    @property
    def is_remat(self) -> bool:
        """Whether blocks recompute activations in the backward pass."""
        return self.remat_name != "none"

    @property
    def remat_name(self) -> str:
        """The policy in effect, by name: the one given; ``'full'`` for ``use_remat``
        alone; else the backend's default (:func:`default_remat_policy`)."""
        if self.remat_policy is not None:
            return self.remat_policy
        if self.use_remat:
            return "full"
        return default_remat_policy(self.use_scan and self.num_stages == 1 and not self.straight)

    @property
    def policy(self) -> Callable | None:
        if self.remat_name.endswith("_offloaded") and jax.default_backend() == "cpu":
            raise ValueError(
                f"remat_policy {self.remat_name!r} moves activations to host memory, which "
                f"the cpu backend does not have apart from its own; use 'minimal' or "
                f"'save_qkv_proj' (the same kept, on the device) or run on a TPU or GPU"
            )
        return remat_policy_fn(self.remat_name)

    def layer_name(self, index: int) -> str:
        """The name of looped block ``index``."""
        return f"{self.loop_name}_{index}"

    def __call__(
        self,
        parent: nn.Module,
        block: type[nn.Module],
        block_kwargs: dict[str, Any],
        x: jax.Array,
        *args: Any,
        use_pipeline: bool = True,
        last_call: dict[str, Any] | None = None,
    ) -> jax.Array:
        """Run the stack inside ``parent``'s compact ``__call__``: ``x [batch,
        length, embed] -> [batch, length, embed]``.

        parent: the calling module (the blocks become its children).
        block, block_kwargs: the block class and its attributes; a list of one
          dict a layer when the layers differ (``use_scan=False`` only).
        args: passed to every block after ``x``; arrays or None.
        use_pipeline: False runs the plain stack even when ``num_stages > 1``
          (decoding, whose cache the pipeline does not thread).
        last_call: keyword arguments of the last block's call alone (e.g.
          :class:`~dew.nn.backbones.block.DecoderBlock`'s ``output_length``, for a
          last layer that does less work); the scanned stack then runs its first
          ``num_layers - 1`` layers as one scan over the same ``[layers, ...]``
          parameters and the last on its slice (the same tree and values). Not with
          a pipeline, nor with a block that sows intermediates.
        """
        per_layer = isinstance(block_kwargs, (list, tuple))
        if per_layer and (self.use_scan or len(block_kwargs) != self.num_layers):
            raise ValueError(
                f"per-layer block options ({len(block_kwargs)}) need use_scan=False and one "
                f"dict for each of the {self.num_layers} layers"
            )
        if last_call and self.num_stages > 1 and use_pipeline:
            raise ValueError(
                f"last_call {sorted(last_call)} (a last layer that differs) does not run in "
                f"a pipeline of {self.num_stages} stages; call without it"
            )
        if self.num_stages > 1 and use_pipeline and not parent.is_initializing():
            return self._pipelined(parent, block, block_kwargs, x, args)
        if last_call and self.use_scan:
            return self._scanned_then_last(parent, block, block_kwargs, x, args, last_call)

        def body_with(call):
            def body(module, carry, *a):
                return module(carry, *a, **call), None

            if self.is_remat:
                return nn.remat(body, prevent_cse=not self.use_scan, policy=self.policy)
            return body

        body = body_with({})
        if self.use_scan and self.straight and not _is_tracing_state(parent):
            straight = self._straight(parent, block, block_kwargs, x, args)
            if straight is not None:
                return straight
        if self.use_scan:
            scanned = nn.scan(
                body,
                variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
                split_rngs={"params": True},
                in_axes=(nn.broadcast,) * len(args),
                length=self.num_layers,
                unroll=self.unroll,
                metadata_params={nn.PARTITION_NAME: axes.LAYERS},
            )
            x, _ = scanned(block(**block_kwargs, name=self.name), x, *args)
            return x
        for i in range(self.num_layers):
            kwargs = block_kwargs[i] if per_layer else block_kwargs
            last = last_call and i == self.num_layers - 1
            x, _ = (body_with(last_call) if last else body)(
                block(**kwargs, name=self.layer_name(i)), x, *args
            )
        return x

    def _straight(self, parent, block, block_kwargs, x, args):
        """Block ``i`` on slice ``i`` of the ``[layers, ...]`` parameters the scan
        created, a Python loop (the same tree and values). On a TPU v5e chip the
        GPT-2 step of docs/performance.md runs as fast as the looped stack's (its
        ``layer_{i}`` parameters) where ``nn.scan`` unrolled writes each layer's
        residuals into stacked buffers. None (the caller scans) when the block sows
        intermediates (a mixture of experts' losses, which the scan stacks) or
        the parameters carry LoRA adapters (qwix matches module paths the loop's
        blocks do not have)."""
        params = nn.meta.unbox(parent.variables["params"][self.name])
        if any("lora" in path_key(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)):
            return None
        module = block(**block_kwargs, parent=None)

        def layer(h, p):
            return module.apply({"params": p}, h, *args, mutable=["intermediates"])

        if self.is_remat:
            layer = jax.checkpoint(layer, policy=self.policy)
        # one split a parameter (its gradient one concatenate), not a slice a layer (a
        # pad each: the compile took twice as long)
        leaves, tree = jax.tree_util.tree_flatten(params)
        split = [jnp.split(leaf, self.num_layers, axis=0) for leaf in leaves]
        for i in range(self.num_layers):
            p = jax.tree_util.tree_unflatten(tree, [parts[i][0] for parts in split])
            x, sown = layer(x, p)
            if jax.tree_util.tree_leaves(sown):
                return None
        return x

    def _scanned_then_last(self, parent, block, block_kwargs, x, args, last_call):
        """The scanned stack with a last layer that differs (``last_call``): layers
        ``0 .. num_layers - 2`` as one scan over their slice of the ``[layers, ...]``
        parameters, then the last layer on its own (the parameters the plain scan
        creates, so the tree and the values are the same)."""
        if parent.is_initializing():  # create the parameters as the plain stack does
            self(parent, block, block_kwargs, x, *args, use_pipeline=False)
        params = nn.meta.unbox(parent.variables["params"][self.name])
        module = block(**block_kwargs, parent=None)

        def layer(h, p, call):
            h, sown = module.apply({"params": p}, h, *args, **dict(call), mutable=["intermediates"])
            if jax.tree_util.tree_leaves(sown):
                raise ValueError(
                    f"last_call {sorted(last_call)}: {block.__name__} sows intermediates "
                    f"(a mixture of experts' losses), which a stack with a last layer that "
                    f"differs does not gather; call without last_call"
                )
            return h

        if self.is_remat:
            layer = jax.checkpoint(layer, policy=self.policy, static_argnums=(2,),
                                   prevent_cse=False)  # fmt: skip
        if self.num_layers > 1:
            head = jax.tree_util.tree_map(lambda p: p[:-1], params)
            x, _ = jax.lax.scan(
                lambda h, p: (layer(h, p, ()), None),
                x,
                head,
                unroll=min(self.unroll, self.num_layers - 1),
            )
        last = jax.tree_util.tree_map(lambda p: p[-1], params)
        return layer(x, last, tuple(sorted(last_call.items())))

    def _pipelined(self, parent, block, block_kwargs, x, args):
        """The stack as a pipeline over the ``[layers, ...]`` parameters that the
        scanned stack created (same tree, same values)."""
        layer_params = nn.meta.unbox(parent.variables["params"][self.name])
        module = block(**block_kwargs, parent=None)
        sows = []  # the names of PIPELINED_SOWN the block sows (known once it is traced)

        def layer_fn(params, carry):
            h, *a = carry
            h, sown = module.apply({"params": params}, h, *a, mutable=["intermediates"])
            leaves = jax.tree_util.tree_leaves_with_path(sown)
            found = {}
            for name in PIPELINED_SOWN:
                values = [
                    v for path, v in leaves if any(getattr(k, "key", None) == name for k in path)
                ]
                if values:
                    found[name] = sum(values)
            sows.append(tuple(found))
            # a block that sows nothing gives the pipeline one scalar 0, as it always has
            return (h, *a), (found or jnp.zeros((), jnp.float32))

        if self.is_remat:
            layer_fn = jax.checkpoint(layer_fn, policy=self.policy)
        (x, *_), aux = pipeline(
            layer_fn,
            layer_params,
            (x, *args),
            num_stages=self.num_stages,
            num_microbatches=self.microbatches,
            num_repeats=self.num_repeats,
        )
        if sows and sows[-1]:
            # the means over layers: [batch] when the block sows per-row values
            for name, value in aux.items():
                parent.sow("intermediates", name, value)
        return x


def path_key(path) -> str:
    """A key path as ``a/b/c``."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _is_tracing_state(parent: nn.Module) -> bool:
    """Whether the stack runs where its scan threads state: the parameters are being
    created, or a decoding cache is written."""
    return parent.is_initializing() or parent.is_mutable_collection("cache")
