"""What a compiled program carries: the ``jax.stages.Compiled`` and the numbers read off
it when it was compiled (the programs of :mod:`dew.train._programs` and of the prepare
phase, :mod:`dew.train._prepare_phase`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from dew.train.model_flops import ModelFlops
from dew.train.packing import Packing


class Compiled(NamedTuple):
    """One compiled program and what was read off it when it was compiled.

    program: the ``jax.stages.Compiled``.
    flops: matrix-product FLOPs of one call (:func:`dew.train.throughput.program_flops`),
      recomputation included.
    packing: how the update step packs its metrics (:mod:`dew.train.packing`);
      None for the other programs.
    peak_bytes: what one device holds at the program's peak
      (:func:`dew.train.memory.peak_bytes`); the update step only, 0 for the others.
    model_flops: the update step's model FLOPs as MaxText counts them
      (:mod:`dew.train.model_flops`); None for the other programs, or when they
      could not be counted (the MFU then divides ``flops``).
    """

    program: Any
    flops: float
    packing: Packing | None = None
    peak_bytes: int = 0
    model_flops: ModelFlops | None = None

    @property
    def mfu_flops(self) -> float:
        """The FLOPs the MFU divides: the model FLOPs when counted, else ``flops``."""
        return self.model_flops.flops if self.model_flops is not None else self.flops
