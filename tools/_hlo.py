"""What a compiled program moves, read off its HLO: the benchmarks' ``--hlo`` lines,
which say where a step's extra time goes when two programs do the same FLOPs.

:func:`traffic` reads a ``jax.stages.Compiled``: XLA's own estimate of the bytes it
accesses (``cost_analysis()``), its temporaries (``memory_analysis()``) and the
``copy`` instructions of its entry computation (a donated buffer that is still read
after an in-place write is copied first: on a memory-bound update each copy is a pass
over its bytes); :func:`compare` prints two programs side by side.
"""

from __future__ import annotations

import os
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (``f32[256,1024]{1,0}``, or a tuple of them)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
    return total


def entry_copies(hlo: str) -> tuple[int, int]:
    """``(count, bytes)`` of the ``copy`` instructions in ``hlo``'s ENTRY computation."""
    start = hlo.find("\nENTRY")
    if start < 0:
        return 0, 0
    end = hlo.find("\n}", start)
    count = size = 0
    for line in hlo[start:end].splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) copy\(", line)
        if m:
            count += 1
            size += shape_bytes(m.group(1))
    return count, size


def traffic(compiled) -> dict:
    """``bytes_accessed``, ``flops`` (XLA's estimates), ``temp_bytes`` and the entry
    computation's ``copies`` / ``copy_bytes`` of a ``jax.stages.Compiled``."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    copies, copy_bytes = entry_copies(compiled.as_text())
    return dict(
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        flops=float(cost.get("flops", 0.0)),
        temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
        copies=copies,
        copy_bytes=copy_bytes,
    )


def compare(name: str, dew, hand) -> str:
    """One line: ``name``'s two compiled programs' traffic, Dew's and the hand-written's;
    with ``HLO_DIR`` set, their HLO texts go there (``{name}_dew.hlo.txt``, ``_hand``)."""
    d, h = traffic(dew), traffic(hand)
    if os.environ.get("HLO_DIR"):  # each program's compiled HLO, to read where they differ
        for side, compiled in (("dew", dew), ("hand", hand)):
            with open(f"{os.environ['HLO_DIR']}/{name}_{side}.hlo.txt", "w") as f:
                f.write(compiled.as_text())
    mib = 2**20
    ratio = d["bytes_accessed"] / max(h["bytes_accessed"], 1.0)
    return (
        f"{name} HLO: bytes accessed dew {d['bytes_accessed'] / 1e9:.3f} GB hand "
        f"{h['bytes_accessed'] / 1e9:.3f} GB ({ratio:.3f}x); "
        f"GFLOP dew {d['flops'] / 1e9:.1f} hand {h['flops'] / 1e9:.1f}; entry copies dew "
        f"{d['copies']} ({d['copy_bytes'] / mib:.1f} MiB) hand {h['copies']} "
        f"({h['copy_bytes'] / mib:.1f} MiB); temporaries dew {d['temp_bytes'] / mib:.0f} MiB "
        f"hand {h['temp_bytes'] / mib:.0f} MiB"
    )
