"""The layout of a checkpoint's state tree: its version (the ``layout`` of its meta,
beside the ``format`` of its files), and the reader of the layouts before this one.

====== ===================================================================
layout the state's tree
====== ===================================================================
1      (no ``layout`` in its meta) the trained parameters of an objective with one
       trained role unkeyed (``params/<path>``), keyed by role with several
2      keyed by role whatever their number (``params/<role>/...``,
       ``averaged/<role>/...``, the optimizer state's parameter trees,
       ``frozen/lora_base/<role>/...``)
====== ===================================================================

:func:`disk_layout` gives the tree to restore a layout-1 checkpoint into,
:func:`run_layout` puts what it read back in this run's layout, array for array, so
it resumes bit for bit.
"""

from __future__ import annotations

import jax

from dew.train._restore import CheckpointMismatchError

LAYOUT = 2
"""The layout this Dew writes: trained parameters keyed by role whatever their number."""
READS = (1, 2)
"""The layouts this Dew reads."""


class CheckpointLayoutError(CheckpointMismatchError):
    """A checkpoint's layout version is not one this Dew reads (a newer Dew wrote it)."""


def layout_of(path: str, meta: dict) -> int:
    """The layout version of the checkpoint at ``path`` (its ``meta``; 1 when it
    records none); raises :class:`CheckpointLayoutError` for one this Dew does not read."""
    layout = meta.get("layout", 1)
    if layout not in READS:
        raise CheckpointLayoutError(
            f"checkpoint {path} has layout version {layout!r}, which this Dew does not "
            f"read: it reads layout versions {list(READS)} (dew.train._layout). A newer Dew "
            f"wrote it: resume it with that version, or point Checkpoints at another "
            f"directory"
        )
    return layout


def _one_role(saved: dict) -> str | None:
    """The trained role of a run that trains one (the one key of ``params``), else None."""
    params = saved.get("params")
    return next(iter(params)) if isinstance(params, dict) and len(params) == 1 else None


def disk_layout(saved: dict, layout: int) -> dict:
    """``saved`` (this run's tree as :func:`dew.train._saved_tree.to_saved` writes it)
    in ``layout``: in layout 1, for a run with one trained role, that role's key
    taken out of ``params``, ``averaged``, the optimizer state's parameter trees and
    ``frozen['lora_base']``; else ``saved`` itself."""
    role = _one_role(saved)
    if layout >= LAYOUT or role is None:
        return saved

    def keyed(node) -> bool:
        return isinstance(node, dict) and list(node) == [role]

    def unkeyed(tree):
        return jax.tree.map(lambda node: node[role] if keyed(node) else node, tree, is_leaf=keyed)

    out = dict(saved)
    for field in ("params", "averaged", "opt_state"):
        if field in out:
            out[field] = unkeyed(out[field])
    frozen = out.get("frozen")
    if isinstance(frozen, dict) and "lora_base" in frozen:
        out["frozen"] = {**frozen, "lora_base": unkeyed(frozen["lora_base"])}
    return out


def run_layout(tree: dict, like: dict) -> dict:
    """``tree`` (read in :func:`disk_layout`'s layout) in the layout of ``like`` (this
    run's): the same arrays in the same order, each role's tree under its key."""
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(tree))
