"""The training iterator's position in a checkpoint: saved with ``get_state``
when the iterator has one, put back with ``set_state``, else fast-forwarded."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any


def iterator_position(iterator: Iterator) -> Any:
    """The iterator's ``get_state()`` (JSON-serialisable, or bytes), or None
    when it cannot save its position."""
    get_state = getattr(iterator, "get_state", None)
    if get_state is None or not callable(getattr(iterator, "set_state", None)):
        return None
    return get_state()


def resume_position(
    iterator: Iterator, restored: Any, *, print_fn: Callable[[str], None]
) -> Iterator:
    """Put a freshly opened training iterator where the restored run left
    off: ``set_state`` when both sides have a position, else skip the
    ``restored.step`` batches the run consumed (with a one-line warning)."""
    if restored is None or restored.step == 0:
        return iterator
    if restored.data_state is not None and callable(getattr(iterator, "set_state", None)):
        iterator.set_state(restored.data_state)
        return iterator
    reason = (
        "cannot save its position (no get_state/set_state)"
        if iterator_position_supported(iterator) is False
        else "has no saved position in the checkpoint"
    )
    print_fn(
        f"Warning: the training iterator ({type(iterator).__name__}) {reason}; "
        f"skipping the {restored.step} batches steps 0..{restored.step - 1} consumed, "
        f"which resumes a deterministic stream exactly"
    )
    for _ in range(restored.step):
        next(iterator)
    return iterator


def iterator_position_supported(iterator: Iterator) -> bool:
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


class _Position:
    """A snapshot of an iterator's position, in the shape Grain's checkpoint
    handler writes (``get_state() -> bytes``) and reads (``set_state(bytes)``).

    The snapshot is taken when ``save`` is called, so a background write
    never sees a later position."""

    def __init__(self, state: Any):
        self.state = state

    def get_state(self) -> bytes:
        if isinstance(self.state, bytes):
            record = {"bytes": self.state.decode()}
        else:
            record = {"state": self.state}
        return json.dumps(record, indent=1).encode()

    def set_state(self, raw: bytes) -> None:
        record = json.loads(raw)
        self.state = record["bytes"].encode() if "bytes" in record else record["state"]

    def start_prefetch(self) -> None:
        pass
