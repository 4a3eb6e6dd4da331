"""The layout of a checkpoint's state tree, by its format (the ``format`` of its
meta), and the reader of the layouts before this one.

====== ===================================================================
format what it records
====== ===================================================================
1      (no ``format`` in its meta) the state, without checksums
2      with a checksum of every array (:mod:`dew.train._integrity`)
3      the trained parameters keyed by role whatever their number
       (``params/<role>/...``, ``averaged/<role>/...``, the optimizer state's
       parameter trees, ``frozen/lora_base/<role>/...``)
====== ===================================================================

Formats 1 and 2 kept the tree of an objective with one trained role unkeyed
(``params/<path>``): :func:`disk_layout` gives the tree to restore such a
checkpoint into, :func:`run_layout` puts what it read back in this run's layout,
array for array, so it resumes bit for bit.
"""

from __future__ import annotations

import jax

from dew.train._restore import CheckpointMismatchError

FORMAT = 3
"""The format this Dew writes."""
READS = (1, 2, 3)
"""The formats this Dew reads."""
ROLE_KEYED = 3
"""The first format whose trained parameters are keyed by role whatever their number."""


class CheckpointFormatError(CheckpointMismatchError):
    """A checkpoint's format is not one this Dew reads (a newer Dew wrote it)."""


def format_of(path: str, meta: dict) -> int:
    """The format of the checkpoint at ``path`` (its ``meta``); raises
    :class:`CheckpointFormatError` for one this Dew does not read."""
    format = meta.get("format", 1)
    if format not in READS:
        raise CheckpointFormatError(
            f"checkpoint {path} has format {format!r}, which this Dew does not read: it "
            f"reads checkpoint formats {list(READS)} (dew.train._layout). A newer Dew "
            f"wrote it: resume it with that version, or point Checkpoints at another "
            f"directory"
        )
    return format


def _one_role(saved: dict) -> str | None:
    """The trained role of a run that trains one (the one key of ``params``), else None."""
    params = saved.get("params")
    return next(iter(params)) if isinstance(params, dict) and len(params) == 1 else None


def disk_layout(saved: dict, format: int) -> dict:
    """``saved`` (this run's tree as :func:`dew.train._saved_tree.to_saved` writes it)
    in the layout of a checkpoint of ``format``: for a format before
    :data:`ROLE_KEYED` and a run with one trained role, that role's key taken out of
    ``params``, ``averaged``, the optimizer state's parameter trees and
    ``frozen['lora_base']``; else ``saved`` itself."""
    role = _one_role(saved)
    if format >= ROLE_KEYED or role is None:
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
