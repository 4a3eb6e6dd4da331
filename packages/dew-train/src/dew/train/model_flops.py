"""Model FLOPs of a training step, counted as MaxText counts them for MFU.

The model FLOPs of one training step are three times the forward pass's
(forward, and the backward's two products per forward product: Kaplan et
al., 2020; Chowdhery et al., 2022, appendix B), where the forward pass is

- every matrix product with a weight operand (``2 * prod(output) *
  prod(contracted)`` for each ``dot_general`` and convolution whose one
  operand is computed from the model's variables alone: the projections, the
  MLP, the LM head; ``6 N T`` in all for a dense decoder), read off the jaxpr
  of the objective's loss on one microbatch, with each scan body times its
  length and a rematerialised (``jax.checkpoint``) body once: the forward pass
  that the backward recomputes is not counted again;
- attention, ``4 * batch * queries * keys * heads * head_dim`` per
  :class:`dew.nn.attention.Attention` call (``Q K^T`` and ``P V``), halved
  when the mask is causal (MaxText halves it; a sliding window is counted as
  causal), from each call's shapes whatever kernel runs it (XLA, a Pallas
  kernel whose products the jaxpr does not show).

Products of two activations (attention's, outside Dew's ``Attention`` too)
are left out when at least one ``Attention`` call was seen, and counted as
they stand otherwise. Frozen roles' forward passes (a DPO reference, a
teacher) are counted three times like the trained ones (an overcount of
``2 x`` their forward), the optimizer update and the prepare phase (rollouts)
not at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.extend.core


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCall:
    """One attention call's shapes: ``batch`` rows, ``queries`` and ``keys``
    positions, ``heads`` query heads of ``head_dim`` features; ``is_causal``."""

    batch: int
    queries: int
    keys: int
    heads: int
    head_dim: int
    is_causal: bool

    @property
    def flops(self) -> float:
        """``4 B Tq Tk H D`` (``Q K^T`` and ``P V``), halved when causal."""
        full = 4.0 * self.batch * self.queries * self.keys * self.heads * self.head_dim
        return full / 2 if self.is_causal else full


@contextlib.contextmanager
def recorded_attention() -> Iterator[list[AttentionCall]]:
    """Record each :class:`dew.nn.attention.Attention` call traced inside the block
    (a decoding call, which reads a cache, is not a training call and is skipped)."""
    from dew.nn.attention import Attention

    calls: list[AttentionCall] = []

    def interceptor(next_fn, args, kwargs, context):
        module = context.module
        if isinstance(module, Attention) and context.method_name == "__call__" and args:
            shape = getattr(args[0], "shape", ())
            if len(shape) == 3 and not kwargs.get("decode", False):
                batch, length, _ = shape
                queries = kwargs.get("query_length") or length
                mask = module.mask
                calls.append(
                    AttentionCall(
                        batch=int(batch),
                        queries=int(queries),
                        keys=int(length),
                        heads=int(module.num_heads),
                        head_dim=int(module.head_dim),
                        is_causal=getattr(mask, "kind", "") == "causal",
                    )
                )
        return next_fn(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield calls


def matmul_flops(jaxpr, weights: int) -> tuple[float, float]:
    """``(products with a weight operand, products of two activations)`` FLOPs of
    ``jaxpr``, whose first ``weights`` inputs are the model's variables: a value
    computed from those alone (a cast, a reshape, a LoRA product) is a weight."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return _count(jaxpr, [i < weights for i in range(len(jaxpr.invars))])


def _count(jaxpr, is_weight: list[bool]) -> tuple[float, float]:
    weight = {v for v, w in zip(jaxpr.invars, is_weight) if w}
    with_weight = between = 0.0

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        # a literal is a constant: as good as a weight next to one
        flags = [_is_literal(v) or v in weight for v in eqn.invars]
        if name in ("dot_general", "conv_general_dilated"):
            flops = _product_flops(eqn)
            if any(flags[:2]):
                with_weight += flops
            else:
                between += flops
        elif name == "scan":
            carry = slice(
                eqn.params["num_consts"], eqn.params["num_consts"] + eqn.params["num_carry"]
            )
            flags[carry] = [False] * (carry.stop - carry.start)  # a carry changes each step
            w, b = _count(eqn.params["jaxpr"].jaxpr, flags)
            with_weight += eqn.params["length"] * w
            between += eqn.params["length"] * b
        elif name == "pallas_call":
            pass  # a kernel: its block-level products are not the call's (attention: counted apart)
        elif name == "cond":
            counts = [_count(b.jaxpr, flags[1:]) for b in eqn.params["branches"]]
            w, b = max(counts, key=sum)
            with_weight, between = with_weight + w, between + b
        elif name == "shard_map":
            mesh, manual = eqn.params["mesh"], eqn.params.get("newly_manual_axes", ())
            copies = math.prod(int(mesh.shape[a]) for a in manual) if manual else mesh.size
            w, b = _count(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]), flags)
            with_weight, between = with_weight + copies * w, between + copies * b
        else:
            for sub in _subjaxprs(eqn):
                inner = getattr(sub, "jaxpr", sub)
                sub_flags = (
                    flags if len(inner.invars) == len(flags) else [False] * len(inner.invars)
                )
                w, b = _count(inner, sub_flags)
                with_weight, between = with_weight + w, between + b
        if all(flags) and any(not _is_literal(v) and v in weight for v in eqn.invars):
            weight.update(eqn.outvars)
    return with_weight, between


def _is_literal(v) -> bool:
    return isinstance(v, jax.extend.core.Literal)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub


def _product_flops(eqn) -> float:
    out = eqn.outvars[0].aval.shape
    if eqn.primitive.name == "dot_general":
        (contracted, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted)
    rhs = eqn.invars[1].aval.shape  # the kernel: out, in / groups, *window
    numbers = eqn.params["dimension_numbers"]
    return 2.0 * math.prod(out) * math.prod(rhs[d] for d in numbers.rhs_spec[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """Model FLOPs of one training step (all devices) and what they are made of.

    flops: ``3 * (matmuls + attention) * microbatches``.
    matmuls: forward FLOPs of one microbatch's products with a weight operand.
    attention: forward FLOPs of one microbatch's attention (causal halved), or of
      its activation-by-activation products when no ``Attention`` call was seen.
    microbatches: loss calls per step (``accumulate``).
    """

    flops: float
    matmuls: float
    attention: float
    microbatches: int


def count_model_flops(loss_fn: Callable, weights, *rest, microbatches: int = 1) -> ModelFlops:
    """:class:`ModelFlops` of ``loss_fn(weights, *rest)``, the forward pass of one
    microbatch; ``weights`` is the tree of the model's variables (trained and
    frozen), ``rest`` the other arguments (abstract or concrete)."""
    with recorded_attention() as calls:
        closed = jax.make_jaxpr(loss_fn)(weights, *rest)
    matmuls, between = matmul_flops(closed, len(jax.tree.leaves(weights)))
    attention = sum(c.flops for c in calls) if calls else between
    return ModelFlops(
        flops=3.0 * (matmuls + attention) * microbatches,
        matmuls=matmuls,
        attention=attention,
        microbatches=microbatches,
    )


def step_model_flops(objective, state, batch, *, accumulate: int = 1) -> ModelFlops:
    """:class:`ModelFlops` of the update step over ``batch`` (the batch the step
    reads: a prepared minibatch's rows, split into ``accumulate`` microbatches):
    the loss of :func:`dew.train.step.weighted_loss_fn` traced on one microbatch
    (abstract shapes suffice), its weights the state's trained, frozen and
    averaged variables."""
    from dew.train.step import weighted_loss_fn

    rows = jax.tree.leaves(batch)[0].shape[0]
    minibatches = objective.prepared_updates.minibatches if objective.has_prepare else 1
    per_call = rows // minibatches // accumulate
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct((per_call, *x.shape[1:]), x.dtype), batch)
    fn = weighted_loss_fn(objective, accumulate)

    def loss(weights, state, micro):
        params, frozen, averaged = weights
        state = state.replace(frozen=frozen, averaged_by_role=averaged)
        return fn(params, state, micro, 0)

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    weights = abstract((state.params_by_role, state.frozen, state.averaged_by_role))
    return count_model_flops(loss, weights, abstract(state), micro, microbatches=accumulate)
