"""The device mesh: ``MeshSpec`` axis sizes, and the rules table that maps
logical axis names (``dew.nn.axes``) onto mesh axes."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from dew.nn import axes
from dew.nn.keywords import check_keywords

MESH_AXES = ("data", "expert", "fsdp", "tensor", "sequence", "stage")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    (axes.EXPERT, "expert"),
    (axes.BATCH, ("data", "fsdp", "expert")),
    (axes.BATCH, ("data", "fsdp")),
    (axes.LENGTH, "sequence"),
    (axes.EMBED, "fsdp"),
    (axes.HEADS, "tensor"),
    (axes.KV_HEADS, "tensor"),
    (axes.MLP, "tensor"),
    (axes.VOCAB, "tensor"),
    (axes.LAYERS, "stage"),
    (axes.HEAD_DIM, None),
    (axes.HEIGHT, None),
    (axes.WIDTH, None),
    (axes.FRAMES, None),
    (axes.CHANNELS, None),
)
"""Logical axis -> mesh axes. Flax goes through the rules in order and gives a
dimension the first rule for its name whose mesh axes no other dimension of
the same array holds yet. So ``embed`` is split over ``fsdp`` in parameters
but not in activations, where ``batch`` already holds ``fsdp``; and in the
per-expert activations of a mixture of experts (``[expert, batch, ...]``)
``expert`` takes the ``expert`` mesh axis first and ``batch`` falls back to
``data`` and ``fsdp``. Override with ``Trainer(..., rules=...)``."""


@check_keywords
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the six mesh axes, in this order.

    data: pure data parallelism (replicated parameters).
    expert: experts of a mixture-of-experts layer; also splits the batch.
    fsdp: parameters, gradients and optimizer state split (ZeRO-3); also
      splits the batch.
    tensor: heads, MLP features and vocab split (Megatron-style).
    sequence: activations split along the sequence (context parallelism).
    stage: the layer stack split into pipeline stages.

    One axis may be -1: it absorbs the devices the others leave. ``data``
    left as None means -1 when no other axis is -1, else 1, so the default
    puts every device on ``data``.

    devices: the devices the mesh spans, in mesh order (keyword only); None =
      ``jax.devices()``, every device of every process. A subset runs a
      reference on one device: ``MeshSpec(data=1, devices=jax.devices()[:1])``.
    """

    data: int | None = None
    expert: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    stage: int = 1
    devices: tuple[jax.Device, ...] | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        for name in MESH_AXES:
            size = getattr(self, name)
            if size is not None and (size == 0 or size < -1):
                raise ValueError(f"MeshSpec.{name} must be >= 1 or -1 (fill), got {size}")
        fills = [n for n in MESH_AXES if getattr(self, n) == -1]
        if len(fills) > 1:
            raise ValueError(f"only one MeshSpec axis may be -1, got {fills}")
        if self.devices is not None:
            if not self.devices:
                raise ValueError("MeshSpec.devices is empty; give at least one device or None")
            object.__setattr__(self, "devices", tuple(self.devices))

    def sizes(self, num_devices: int) -> dict[str, int]:
        """The resolved ``{axis: size}`` for ``num_devices`` devices."""
        raw = {n: getattr(self, n) for n in MESH_AXES}
        if raw["data"] is None:
            raw["data"] = 1 if -1 in raw.values() else -1
        fixed = math.prod(v for v in raw.values() if v != -1)
        if -1 in raw.values():
            fill = next(n for n, v in raw.items() if v == -1)
            if num_devices % fixed:
                raise ValueError(
                    f"MeshSpec {self._show(raw)} cannot fill {fill!r}: the other axes use "
                    f"{fixed} devices, which does not divide the {num_devices} devices present"
                )
            raw[fill] = num_devices // fixed
        elif fixed != num_devices:
            where = "given in MeshSpec.devices" if self.devices is not None else "present"
            raise ValueError(
                f"MeshSpec {self._show(raw)} needs {fixed} devices but {num_devices} are "
                f"{where} ({num_devices} x {jax.devices()[0].device_kind}, "
                f"{jax.process_count()} process(es)); make the product {num_devices} or "
                f"set one axis to -1"
            )
        return raw

    @staticmethod
    def _show(raw):
        return "{" + ", ".join(f"{k}={v}" for k, v in raw.items()) + "}"

    def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``jax.sharding.Mesh`` over ``devices`` (default ``self.devices``,
        else every device), axes in :data:`MESH_AXES` order, ``Auto`` axis types
        (what Flax's logical partitioning needs)."""
        if devices is None:
            devices = self.devices if self.devices is not None else jax.devices()
        devices = list(devices)
        sizes = self.sizes(len(devices))
        return jax.make_mesh(
            tuple(sizes.values()),
            MESH_AXES,
            axis_types=(AxisType.Auto,) * len(MESH_AXES),
            devices=devices,
        )


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    return {name: int(mesh.shape[name]) for name in MESH_AXES}


def batch_axes(rules: Rules) -> tuple[str, ...]:
    """Mesh axes the batch dimension is split over."""
    for logical, mesh_axes in rules:
        if logical == axes.BATCH:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    return ()


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """Rows split over the batch axes; other dimensions replicated. One object per
    (mesh, rules, ndim): every batch of a run is placed with the same sharding, which
    JAX then recognises without comparing specs again."""
    try:
        return _batch_sharding(mesh, tuple(rules), ndim)
    except TypeError:  # rules that do not hash (lists inside)
        return _batch_sharding.__wrapped__(mesh, rules, ndim)


@functools.lru_cache(maxsize=64)
def _batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(batch_axes(rules), *([None] * (ndim - 1))))


def data_parallel_size(mesh: Mesh, rules: Rules) -> int:
    return math.prod(int(mesh.shape[a]) for a in batch_axes(rules))


def logical_shardings(specs, mesh: Mesh, rules: Rules):
    """Logical ``PartitionSpec`` tree -> ``NamedSharding`` tree."""
    return nn.logical_to_mesh_sharding(specs, mesh, list(rules))


def check_divisible(abstract, specs, mesh: Mesh, rules: Rules) -> None:
    """Every dimension divides over the mesh axes it is split on, or a clear error."""
    shardings = logical_shardings(specs, mesh, rules)
    flat_abs = jax.tree_util.tree_leaves_with_path(abstract)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    flat_shard = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, leaf), logical, sharding in zip(flat_abs, flat_specs, flat_shard):
        for dim, (size, mesh_axes) in enumerate(zip(leaf.shape, sharding.spec)):
            if mesh_axes is None:
                continue
            names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
            ways = math.prod(int(mesh.shape[a]) for a in names)
            if size % ways:
                name = logical[dim] if dim < len(logical) else None
                raise ValueError(
                    f"{jax.tree_util.keystr(path)}: dimension {dim} ({name!r}) of size {size} "
                    f"does not divide over mesh axis {'x'.join(names)} of size {ways}; "
                    f"change the model size or the MeshSpec"
                )


def optimizer_specs(opt_state, params, mesh: Mesh, rules: Rules):
    """Logical ``PartitionSpec`` of every array of an optimizer state built
    from logically partitioned ``params`` (both still boxed), each one fitting
    its own shape.

    ``optimizer.init`` maps over the parameter boxes, so a state array inherits
    its parameter's axis names even when its shape differs (Adafactor's
    factored moments drop a dimension; its placeholders are ``[1]``). An array
    shaped like its parameter keeps the parameter's names. Any other array
    takes, dimension by dimension in order, the name of the next parameter
    dimension of the same size; a dimension with no such match, or whose mesh
    axes do not divide it, is replicated. The parameter is the one whose path
    ends the state array's path (``opt_state/0/mu/dense/kernel`` ->
    ``dense/kernel``); an array with no such parameter is replicated where it
    does not fit. Arrays outside any box (step counts) are replicated.
    """
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    reference = {}
    for path, box in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
        if isinstance(box, nn.LogicallyPartitioned):
            reference[_path_names(path)] = (tuple(box.value.shape), tuple(box.names))

    def parameter_of(path):
        names = _path_names(path)
        for start in range(len(names)):
            if names[start:] in reference:
                return reference[names[start:]]
        return None

    def fit(path, node):
        if not isinstance(node, nn.meta.AxisMetadata):
            return jax.tree.map(lambda _: PartitionSpec(), node)
        if not isinstance(node, nn.LogicallyPartitioned):  # other boxes: as Flax gives them
            spec = node.get_partition_spec()
            return jax.tree.map(lambda _: spec, node.value)
        found = parameter_of(path)
        return jax.tree.map(
            lambda leaf: _fitted_spec(tuple(leaf.shape), tuple(node.names), found, mesh, rules),
            node.value,
        )

    return jax.tree_util.tree_map_with_path(fit, opt_state, is_leaf=is_box)


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _fitted_spec(shape, names, parameter, mesh: Mesh, rules: Rules) -> PartitionSpec:
    if parameter is not None and shape != parameter[0]:
        parameter_shape, names = parameter
        logical, start = [], 0
        for size in shape:
            match = next(
                (d for d in range(start, len(parameter_shape)) if parameter_shape[d] == size), None
            )
            logical.append(None if match is None else names[match])
            start = start if match is None else match + 1
    elif len(names) == len(shape):
        logical = list(names)
    else:
        logical = [None] * len(shape)
    mesh_spec = nn.logical_to_mesh_axes(logical, list(rules))
    for dim, (size, mesh_axes) in enumerate(zip(shape, mesh_spec)):
        if mesh_axes is None:
            continue
        names_of = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        if size % math.prod(int(mesh.shape[a]) for a in names_of):
            logical[dim] = None
    return PartitionSpec(*logical)


def unbox_abstract(tree):
    return jax.tree.map(
        lambda x: x.value if isinstance(x, nn.meta.AxisMetadata) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata),
    )
