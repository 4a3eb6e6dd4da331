"""Device memory as a budget: what one device holds, and the refusal of a step
that needs more, before it runs.

A compiled step's need is :func:`peak_bytes` of XLA's ``memory_analysis()``
(arguments + outputs - donated + temporaries, on one device). The device's
memory is ``device.memory_stats()['bytes_limit']`` on a TPU or GPU; a CPU has
no limit. ``$DEW_DEVICE_MEMORY`` (e.g. ``16GiB``, or bytes) or an explicit
``device_memory_bytes`` overrides both, so the refusal can be seen on a CPU.
"""

from __future__ import annotations

import os
import re

ENV = "DEW_DEVICE_MEMORY"

ADVICE = (
    "To fit, keep fewer activations for the backward pass (a backbone's remat policy, "
    "e.g. remat_policy='full' or use_remat=True), split the batch into microbatches "
    "(Trainer(accumulate=k)) or use a smaller batch, or shard the parameters and "
    "optimizer state over more devices (MeshSpec(fsdp=N)); `dew plan RECIPE "
    "--device-memory SIZE --recommend` finds the fastest remat policy x accumulate "
    "that fits"
)


class StepDoesNotFit(MemoryError):
    """The compiled training step needs more memory than one device has."""


def parse_bytes(text: str | int) -> int:
    """``'16GiB'``, ``'80GB'``, ``'512M'`` or a number of bytes -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)i?B?\s*", str(text), re.I)
    if not match:
        raise ValueError(f"memory size {text!r}: give bytes or a size such as 16GiB or 80GB")
    scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def device_memory_bytes(devices, override: int | str | None = None) -> int | None:
    """Bytes one of ``devices`` may hold: ``override`` when given, else
    ``$DEW_DEVICE_MEMORY``, else the smallest ``memory_stats()['bytes_limit']`` of
    the devices; None when none is known (a CPU)."""
    if override is not None:
        return parse_bytes(override)
    if os.environ.get(ENV):
        return parse_bytes(os.environ[ENV])
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats() or {}
        except Exception:  # a backend without memory statistics (CPU)
            stats = {}
        if stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def peak_bytes(memory) -> int:
    """arguments + outputs - donated (aliased) + temporaries of XLA's ``memory_analysis()``."""
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def check_fits(needed: int, available: int | None, *, what: str = "the training step") -> None:
    """Raise :class:`StepDoesNotFit` when ``needed`` bytes exceed ``available``
    (None: no limit known, nothing checked)."""
    if available is None or needed <= available:
        return
    raise StepDoesNotFit(
        f"{what} needs {needed:,} bytes ({format_bytes(needed)}) on one device, which has "
        f"{available:,} bytes ({format_bytes(available)}); nothing ran. {ADVICE}"
    )


def is_out_of_memory(error: BaseException) -> bool:
    """XLA's out-of-memory error (at compile time on a TPU: 'RESOURCE_EXHAUSTED')."""
    return "RESOURCE_EXHAUSTED" in str(error) or "Ran out of memory" in str(error)


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
