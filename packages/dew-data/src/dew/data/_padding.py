"""Token ids cut and padded to a fixed length, with a mask of the real ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_id_of(tokenizer, pad_id: int | None) -> int:
    """``pad_id`` if given, else the tokenizer's ``pad_id``, else its ``end_id``, else 0."""
    if pad_id is not None:
        return pad_id
    for name in ("pad_id", "end_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def pad_right(ids: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``length`` ids then ``pad_id``: (int32 ``[length]``, bool mask ``[length]``)."""
    ids = list(ids)[:length]
    out = np.full((length,), pad_id, np.int32)
    out[: len(ids)] = ids
    mask = np.zeros((length,), bool)
    mask[: len(ids)] = True
    return out, mask


def pad_left(ids: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``pad_id`` then the last ``length`` ids: (int32 ``[length]``, bool mask ``[length]``)."""
    ids = list(ids)[-length:] if length else []
    out = np.full((length,), pad_id, np.int32)
    mask = np.zeros((length,), bool)
    if ids:
        out[length - len(ids) :] = ids
        mask[length - len(ids) :] = True
    return out, mask
