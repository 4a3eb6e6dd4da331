"""Throughput and model FLOPs utilisation (MFU) of the compiled training step.

MFU (Chowdhery et al., 2022, PaLM, appendix B) is the model's FLOPs per
second divided by the devices' peak:

    MFU = step_flops / step_seconds / (devices * peak_per_device)

``step_flops`` are the step's model FLOPs as MaxText counts them
(:mod:`dew.train.model_flops`: three times the forward pass's products with
a weight operand plus attention, causal attention halved, recomputation not
counted). Where those cannot be counted, the step's program is
(:func:`program_flops`): every matrix product (``dot_general``:
``2 * batch * M * N * K``; the forward pass, its gradient and the
optimizer's, as XLA compiles them), with each
``scan`` body counted once per iteration. XLA's own cost analysis of a
compiled step (``compiled.cost_analysis()["flops"]``) counts a ``while``
loop's body only once, so it under-counts a scanned layer stack by the
number of layers; on an unrolled program the two agree up to the
elementwise operations XLA adds (see the tests).

The peak (:func:`device_peak`) comes from a table of dense bf16 peaks for
known accelerators (TPU v3, v4, v5e = ``'TPU v5 lite'``, v5p, v6e = ``'TPU v6
lite'``; A100, H100, H200, ...); on a CPU, from a matrix-multiply probe measured
once per machine (:func:`cpu_peak`) and cached on disk
(``~/.cache/dew/cpu_peak.json``, or ``$DEW_CACHE_DIR``), named as such in the
log. ``Trainer(peak_flops=)`` or ``$DEW_PEAK_FLOPS`` (FLOP/s of one device)
overrides both; a device kind the table does not know shows MFU as unknown,
with how to pass its peak.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

# Dense peak FLOP/s per chip (bf16 / tensor cores, no sparsity), from the
# vendors' data sheets; matched against jax's device_kind, longest name first.
PEAKS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe card is 756e12
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
    "B200": 2250e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
    "TPU v3": 123e12,
}

# 1024: on a 2-core AMD EPYC a 512 probe read 62-103 GFLOP/s a core when quiet and 23.8
# under load (too small to keep the cores busy); 1024 read 100-104 (docs/performance.md)
PROBE_SIZE = 1024
PEAK_ENV = "DEW_PEAK_FLOPS"
UNKNOWN_PEAK_HELP = (
    "pass Trainer(peak_flops=<bf16 FLOP/s of one device>) or set DEW_PEAK_FLOPS (e.g. 197e12)"
)
CACHE_NAME = "cpu_peak.json"


def program_flops(jaxpr) -> float:
    """Matrix-product FLOPs of a (closed) jaxpr: ``2 * prod(output) * prod(contracted)``
    for every ``dot_general`` (a convolution: ``2 * prod(output) * in / groups x
    window``), scan bodies times their length, a ``shard_map`` body (per-device
    shapes) times the devices it runs on (its manual mesh axes), other nested
    programs (jit, remat, custom derivatives, the larger ``cond`` branch) once; a
    Pallas kernel (``pallas_call``) not at all."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracted)
            continue
        if name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape  # the kernel: out, in / groups, *window
            numbers = eqn.params["dimension_numbers"]
            kernel = math.prod(rhs[d] for d in numbers.rhs_spec[1:])  # in / groups x window
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * kernel
            continue
        if name == "scan":
            total += eqn.params["length"] * program_flops(eqn.params["jaxpr"])
            continue
        if name == "shard_map":
            mesh, manual = eqn.params["mesh"], eqn.params.get("newly_manual_axes", ())
            copies = math.prod(int(mesh.shape[a]) for a in manual) if manual else mesh.size
            total += copies * program_flops(eqn.params["jaxpr"])
            continue
        if name == "cond":
            total += max(program_flops(b) for b in eqn.params["branches"])
            continue
        if name == "pallas_call":
            continue  # a kernel's body holds one block's products, not the call's
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    total += program_flops(sub)
    return total


def device_peak(devices, peak_flops: float | None = None) -> tuple[float, str]:
    """``(peak FLOP/s of ``devices`` together, where the number comes from)``.

    ``peak_flops`` (or ``$DEW_PEAK_FLOPS``): one device's peak, times the devices.
    Accelerators: the table's peak per chip times the chips; NaN for a device kind
    the table does not know. CPU devices (emulated ones share the machine's
    cores): the probe's per-core peak times the cores this process may run on,
    whatever the device count.
    """
    devices = list(devices)
    if not devices:
        return float("nan"), "no devices"
    if peak_flops is None and os.environ.get(PEAK_ENV):
        peak_flops = float(os.environ[PEAK_ENV])
    if peak_flops is not None:
        if not peak_flops > 0:
            raise ValueError(f"peak_flops must be > 0 FLOP/s per device, got {peak_flops}")
        return peak_flops * len(devices), (
            f"{len(devices)} x {peak_flops / 1e12:g} TFLOP/s as given"
        )
    device = devices[0]
    if device.platform == "cpu":
        per_core, source = cpu_peak()
        cores = available_cores()
        return per_core * cores, f"{source}: {cores} core(s) x {per_core / 1e9:.1f} GFLOP/s"
    kind = getattr(device, "device_kind", "") or ""
    for name in sorted(PEAKS, key=len, reverse=True):
        if name.lower() in kind.lower():
            peak = PEAKS[name] * len(devices)
            return peak, f"{len(devices)} x {name} at {PEAKS[name] / 1e12:g} TFLOP/s (bf16 dense)"
    return float("nan"), f"no peak known for device kind {kind!r}: {UNKNOWN_PEAK_HELP}"


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def cache_dir() -> str:
    return os.environ.get("DEW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dew")


def cpu_peak() -> tuple[float, str]:
    """``(per-core float32 FLOP/s, source)``: a jitted ``PROBE_SIZE``-square float32
    matmul probe, the best of several timings divided by the cores it ran on;
    measured once per machine (CPU model, core count, jax version, probe size) and
    cached."""
    machine = platform.processor() or platform.machine()
    token = f"{machine}|{os.cpu_count()}|{jax.__version__}|{PROBE_SIZE}"
    path = os.path.join(cache_dir(), CACHE_NAME)
    # one entry per machine token, so two jax versions on one machine keep theirs
    try:
        with open(path) as f:
            cached = json.load(f)
        if not isinstance(cached, dict):
            cached = {}
        if "machine" in cached:  # the single-entry form of earlier versions
            cached = {cached["machine"]: cached.get("per_core_flops")}
        if isinstance(cached.get(token), (int, float)):
            return float(cached[token]), "CPU peak measured by matmul probe (cached)"
    except (OSError, ValueError, KeyError, TypeError):
        cached = {}
    per_core = probe_cpu()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w") as f:
            json.dump({**cached, token: per_core}, f)
        os.replace(temporary, path)
    except OSError:
        pass
    return per_core, "CPU peak measured by matmul probe"


def probe_cpu(size: int = PROBE_SIZE, repeats: int = 5) -> float:
    """Per-core FLOP/s of a float32 ``size x size`` matmul chain on the CPU."""
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((size, size), np.float32), cpu)
    chain = 8

    @jax.jit
    def mm(x):
        for _ in range(chain):
            x = jnp.tanh(x @ a)  # tanh keeps values finite; negligible next to the product
        return x

    # its own one-device mesh: the caller may be inside the run's mesh (jax.set_mesh),
    # whose devices this one-device array does not span
    with jax.set_mesh(jax.sharding.Mesh(np.array([cpu]), ("probe",))):
        mm(a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            mm(a).block_until_ready()
            best = min(best, time.perf_counter() - begin)
    flops = 2.0 * size**3 * chain
    return flops / best / available_cores()


class Throughput:
    """The step's FLOPs and the devices' peak, for the log line's rates and MFU.

    step_flops: FLOPs of one training step: model FLOPs
      (:mod:`dew.train.model_flops`), or :func:`program_flops` of the step.
    devices: the devices the step runs on.
    peak_flops: one device's peak FLOP/s; None = :func:`device_peak`'s.
    is_model_flops: ``step_flops`` are model FLOPs (else the compiled step's products).
    """

    def __init__(self, step_flops: float, devices, *, peak_flops=None, is_model_flops: bool = True):
        self.step_flops = float(step_flops)
        self.is_model_flops = is_model_flops
        self.peak, self.source = device_peak(devices, peak_flops)

    def line(self) -> str:
        """What the log says once, before the first step."""
        counted = (
            "model FLOPs: 3 x forward, causal attention halved, recomputation not counted"
            if self.is_model_flops
            else "matrix products of the compiled step, recomputation included"
        )
        if not self.peak > 0:
            return (
                f"Throughput: {self.step_flops / 1e9:,.3f} GFLOP per step ({counted}); MFU "
                f"unknown ({self.source})"
            )
        return (
            f"Throughput: {self.step_flops / 1e9:,.3f} GFLOP per step ({counted}); MFU against "
            f"{self.peak / 1e9:,.1f} GFLOP/s ({self.source})"
        )

    def mfu(self, step_seconds: float) -> float:
        """Model FLOPs utilisation of a step that took ``step_seconds``."""
        if not step_seconds > 0 or not self.peak > 0:
            return float("nan")
        return self.step_flops / step_seconds / self.peak
