"""Low-rank adapters (LoRA, Hu et al. 2021, https://arxiv.org/abs/2106.09685) on any
Dew model, through qwix (as Tunix does).

A targeted dense contraction ``y = x W`` with a frozen kernel ``W [in, out]``
becomes

    y = x W + (alpha / rank) * (x A) B,    A [in, rank], B [rank, out]

with ``A`` drawn He-uniform and ``B`` zero, so a fresh adapter leaves the
model's output unchanged. qwix intercepts the model's ``jax.lax.dot_general``
calls against a parameter, inside the modules whose path matches a target, and
keeps each adapter next to its kernel: ``query_kernel`` gets
``query_kernel_lora_a`` and ``query_kernel_lora_b`` in the same module (a
kernel of several input or output axes, ``[embed, heads, head_dim]``, has them
flattened: ``B [rank, heads * head_dim]``; a scanned stack's adapters carry the
leading ``[layers, ...]`` axis like its kernels).

    lora = LoRA(rank=8, alpha=16, targets=("layers/attention", "layers/mlp/.*"))
    model = lora.apply(CausalTransformer(...))       # a Flax module
    variables = model.init(key, tokens)              # base + adapters
    base, adapters = split(variables["params"])      # train only the adapters
    merged = fold(variables["params"], lora)         # W + (alpha/rank) A B: a plain tree

Targets are regular expressions over module paths (``'/'``-joined, as in the
parameter tree: ``layers/attention``, ``layers/mlp/up``, ``lm_head``), matched
whole (``re.fullmatch``). A target that matches no module with a kernel is an
error that lists the module paths there are.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dew.nn.backbones import layer_stack_of
from dew.nn.keywords import is_whole_number

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
    """Which kernels get low-rank adapters, and their size.

    rank: the adapters' inner dimension ``r`` (>= 1).
    alpha: the scale numerator: the update is ``(alpha / rank) * A B`` (PEFT's ``lora_alpha``).
    targets: regular expressions over module paths (``'layers/attention'``,
      ``'layers/mlp/(up|gate)'``), each matched whole and each matching at least
      one module with a kernel; a single string is one target.
    dropout: must be 0: Dew's objectives apply models deterministically (no
      ``dropout`` key), so LoRA dropout has no key to draw from.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] | str = (".*",)
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        if not is_whole_number(self.rank) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an int >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(
                f"LoRA alpha must be > 0 (the update is alpha/rank * A B), got {self.alpha}"
            )
        if not self.targets:
            raise ValueError("LoRA needs at least one target module pattern, got targets=()")
        for target in self.targets:
            try:
                re.compile(target)
            except re.error as error:
                raise ValueError(
                    f"LoRA target {target!r} is not a regular expression: {error}"
                ) from None
        if self.dropout != 0:
            raise ValueError(
                f"LoRA dropout={self.dropout}: Dew's objectives apply models without a dropout "
                f"key, so adapter dropout cannot draw; use dropout=0"
            )

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``A B``."""
        return self.alpha / self.rank

    def apply(self, module: nn.Module, *example_inputs: Any) -> nn.Module:
        """``module`` with adapters on the targeted kernels: a Flax module whose
        ``init`` creates the base parameters and the adapters and whose ``apply``
        takes both (``merge(base, adapters)``).

        example_inputs: inputs to trace the module with (shapes only); default
          ``module.example_inputs()`` when it has one, else ``[1, 1]`` token ids.
        Raises ValueError when a target matches no module with a kernel.
        """
        if lora_of(module) is not None:
            raise ValueError(
                f"{type(module).__name__} already has LoRA adapters ({lora_of(module)})"
            )
        inputs = example_inputs or _example_inputs(module)
        specs = type(_wrap(module, self.targets, self, inputs)).dew_specs
        found = sorted({"/".join(p[:-1]) for p in specs})
        missing = [t for t in self.targets if not any(re.fullmatch(t, p) for p in found)]
        if missing:
            able = sorted(
                {"/".join(p[:-1]) for p in type(_wrap(module, (".*",), self, inputs)).dew_specs}
            )
            raise ValueError(
                f"LoRA target(s) {missing} match no module of {type(module).__name__} with a "
                f"kernel; its modules with kernels are: {', '.join(able)}. Targets are regular "
                f"expressions matched against the whole '/'-joined module path"
            )
        # One rule over the matched paths, in both layouts of a layer stack: decoding
        # unrolls a scanned stack (``layers/attention`` -> ``layer_0/attention``, ...).
        return _wrap(module, _both_layouts(module, found), self, inputs, specs=specs)


def _both_layouts(module: nn.Module, paths: list[str]) -> tuple[str, ...]:
    """Exact patterns for ``paths`` and, in a layer stack, their other layout."""
    patterns = [re.escape(p) for p in paths]
    stack = layer_stack_of(module)
    if stack is not None:
        for path in paths:
            head, _, rest = path.partition("/")
            if head == stack.name and rest:
                patterns.append(rf"{re.escape(stack.loop_name)}_\d+/{re.escape(rest)}")
    return ("|".join(f"(?:{p})" for p in patterns),)


def _wrap(
    module: nn.Module, targets: tuple[str, ...], lora: LoRA, inputs: tuple, specs=None
) -> nn.Module:
    import qwix

    rules = [
        qwix.LoraRule(
            module_path=target,
            rank=lora.rank,
            alpha=lora.alpha,
            # dot_general only: every Dew kernel contraction is one (attention, Dense);
            # qwix's einsum path cannot record its debug string on a linen module.
            op_names=("dot_general",),
        )
        for target in targets
    ]
    wrapped = qwix.apply_lora_to_model(module, qwix.LoraProvider(rules))
    # The adapters' shapes and logical axes, traced once here, outside any mesh: qwix
    # re-boxes a new adapter by unboxing it under its kernel's axis names, which a
    # mesh turns into a sharding constraint of the wrong rank.
    # (``specs`` given: the same adapters, already traced.)
    if specs is None:
        boxes = _flatten(jax.eval_shape(wrapped.init, jax.random.key(0), *inputs)["params"])
        specs = {p: box for p, box in boxes.items() if is_adapter(p)}
    # qwix made this class for this call: tag it with the config and the base module,
    # and initialise through the base module plus adapters made from ``specs`` (qwix
    # then finds them and creates nothing).
    cls = type(wrapped)
    cls.dew_lora = lora
    cls.dew_base = module
    cls.dew_specs = specs
    cls.init = functools.partialmethod(_init_with_adapters, specs=specs)
    return wrapped


def _init_with_adapters(self, rngs, *args, specs, **kwargs):
    """``base.init(...)`` plus adapters: ``A`` He-uniform over its input axis (per
    layer of a scanned stack), ``B`` zero, as qwix's ``LoraRule`` defaults draw them."""
    variables = dict(type(self).dew_base.init(rngs, *args, **kwargs))
    key = rngs["params"] if isinstance(rngs, Mapping) else rngs
    key = jax.random.fold_in(key, 0x10A)  # a stream of its own, away from the base's draws
    adapters = {}
    for i, (path, box) in enumerate(sorted(specs.items())):
        spec = nn.unbox(box)
        if path[-1].endswith("_lora_b"):
            value = jnp.zeros(spec.shape, spec.dtype)
        else:
            lead = tuple(range(len(spec.shape) - 2))
            init = nn.initializers.he_uniform(in_axis=-2, out_axis=-1, batch_axis=lead)
            value = init(jax.random.fold_in(key, i), spec.shape, spec.dtype)
        adapters[path] = (
            box.replace_boxed(value) if isinstance(box, nn.meta.AxisMetadata) else value
        )
    variables["params"] = merge(variables["params"], _unflatten(adapters))
    return variables


def lora_of(module: Any) -> LoRA | None:
    """The :class:`LoRA` a module was built with by :meth:`LoRA.apply`, else None."""
    return getattr(type(module), "dew_lora", None)


def base_module(module: nn.Module) -> nn.Module:
    """The module without adapters (``module`` itself when it has none)."""
    return getattr(type(module), "dew_base", module)


def _example_inputs(module: nn.Module) -> tuple:
    example = getattr(module, "example_inputs", None)
    if example is not None:
        return tuple(example())
    return (jax.ShapeDtypeStruct((1, 1), jnp.int32),)


def adapter_modules(module: nn.Module, *example_inputs: Any) -> list[str]:
    """The ``'/'``-joined module paths where ``module`` (a LoRA module) keeps adapters."""
    inputs = example_inputs or _example_inputs(module)
    shapes = jax.eval_shape(module.init, jax.random.key(0), *inputs)
    flat = _flatten(nn.unbox(shapes["params"]))
    return sorted({"/".join(p[:-1]) for p in flat if is_adapter(p)})


def is_adapter(path) -> bool:
    """Whether a parameter path (a tuple of names or a ``'/'``-joined string) is an adapter."""
    name = path.rsplit("/", 1)[-1] if isinstance(path, str) else str(path[-1])
    return name.endswith(ADAPTER_SUFFIXES)


def _flatten(tree, prefix=()) -> dict[tuple, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _unflatten(flat: Mapping[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def split(params: Mapping) -> tuple[dict, dict]:
    """``(base, adapters)``: the parameter tree without its adapter leaves, and the
    adapter leaves alone (the same nesting). Boxed leaves stay boxed."""
    flat = _flatten(params)
    base = {p: v for p, v in flat.items() if not is_adapter(p)}
    adapters = {p: v for p, v in flat.items() if is_adapter(p)}
    return _unflatten(base), _unflatten(adapters)


def merge(base: Mapping, adapters: Mapping) -> dict:
    """The union of two trees of disjoint leaves (``split``'s inverse): what a LoRA
    module's ``apply`` reads."""
    flat = _flatten(base)
    extra = _flatten(adapters)
    both = sorted("/".join(map(str, p)) for p in set(flat) & set(extra))
    if both:
        raise ValueError(f"merge: the base and the adapters both hold {both[:4]}")
    return _unflatten({**flat, **extra})


def fold(params: Mapping, lora: LoRA) -> dict:
    """A plain parameter tree: every adapted kernel replaced by
    ``W + (alpha / rank) * A B`` (computed in float32, cast to ``W``'s dtype), the
    adapters dropped. The base module computes with it what the LoRA module
    computes with ``params``."""
    flat = _flatten(params)
    out = {}
    for path, value in flat.items():
        if is_adapter(path):
            continue
        a = flat.get((*path[:-1], f"{path[-1]}_lora_a"))
        b = flat.get((*path[:-1], f"{path[-1]}_lora_b"))
        if a is None and b is None:
            out[path] = value
            continue
        out[path] = value + delta(value.shape, a, b, lora.scale).astype(value.dtype)
    return _unflatten(out)


def delta(shape: tuple[int, ...], a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A B`` in the kernel's own layout ``shape`` (float32).

    qwix flattens the contracted axes into ``A [..., in, rank]`` and the others into
    ``B [..., rank, out]`` (``...``: a scanned stack's layers); a Dew kernel keeps its
    contracted axes first (``[embed, heads, head_dim]``, ``[heads, head_dim, embed]``),
    so ``A B`` reshapes into it.
    """
    lead = b.shape[:-2]
    rank = b.shape[-2]
    a = jnp.asarray(a, jnp.float32).reshape(*lead, -1, rank)
    b = jnp.asarray(b, jnp.float32)
    product = jnp.matmul(a, b)  # [..., in, out]
    if product.size != math.prod(shape):
        raise ValueError(
            f"LoRA adapters A {tuple(a.shape)} B {tuple(b.shape)} do not fit the kernel {shape}"
        )
    return scale * product.reshape(shape)
