"""Data-parallel splitting on the CPU: two XLA:CPU devices where the host has the cores.

On a CPU-only host, XLA runs one program at a time on its intra-op threads. A
training step split over two emulated CPU devices (half the batch each, the
gradients summed by one all-reduce) runs two half-size programs side by side,
and on 2 cores a medium-size LM step is ~1.4-1.5x faster that way; a small
step is slower (the second device's dispatch and the all-reduce cost more than
they save). Both measured in docs/performance.md ("Data-parallel splitting on
the CPU").

Emulated devices exist only if JAX is told before it starts its CPU backend
(``jax_num_cpu_devices``). So :func:`configure_cpu_devices` runs when
``dew.train`` is imported and, where that is safe, asks for them; the
:class:`~dew.train.Trainer` then chooses, for each run on its default mesh,
whether the step is large enough to use them (:func:`choose`), and says so in
its start line. The environment variable ``DEW_CPU_DEVICES`` decides:

- ``auto`` (the default; also when unset or empty): 2 CPU devices when this
  process may use at least 2 cores; the trainer splits a step of at least
  :data:`SPLIT_FROM_FLOPS` estimated FLOPs and keeps a smaller one on the first
  device (what the process would have had without Dew);
- ``off``: leave JAX's device count alone (one CPU device);
- a whole number ``N >= 1``: ``N`` CPU devices, and the default mesh uses them
  all, whatever the step's size (as ``--xla_force_host_platform_device_count``).

With more than one device Dew also gives XLA:CPU's intra-op thread pool at least
one thread more than devices (``NPROC``, unless already set): with only as many
threads as devices a split step can wait on itself (:func:`intra_op_threads`).

Dew asks for nothing when the count is already set (``XLA_FLAGS`` with
``--xla_force_host_platform_device_count``, or ``jax_num_cpu_devices``), when
JAX's backends are already running (Dew was imported after the first
``jax.devices()``), or when ``JAX_PLATFORMS`` leaves the CPU out. Any other
value of ``DEW_CPU_DEVICES`` is an error naming the accepted ones.
"""

from __future__ import annotations

import os

import jax

from dew.train.throughput import available_cores, program_flops

ENV = "DEW_CPU_DEVICES"
AUTO_DEVICES = 2
"""Devices ``auto`` asks for: measured on 2 cores (docs/performance.md)."""

SPLIT_FROM_FLOPS = 4e9
"""``auto`` splits a step whose estimated FLOPs (:func:`step_flops_estimate`) reach
this; below it the step stays on one device. Measured: docs/performance.md."""

_configured: dict | None = None


def requested() -> str | int:
    """``DEW_CPU_DEVICES`` checked: ``'auto'`` (unset or empty), ``'off'`` or a count."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower() or "auto"
    if value in ("auto", "off"):
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(
        f"{ENV}={raw!r} is not understood; use 'auto' (the default: 2 CPU devices where "
        f"the process has 2 cores, used for steps large enough to gain), 'off' (one CPU "
        f"device, JAX's own default) or a whole number N >= 1 (N CPU devices, always "
        f"used), or unset it"
    )


def _blocked() -> str | None:
    """Why Dew must not set the CPU device count now, or None."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return "XLA_FLAGS sets the device count"
    if jax.config.jax_num_cpu_devices != -1:
        return f"jax_num_cpu_devices is already {jax.config.jax_num_cpu_devices}"
    platforms = os.environ.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or "")
    if platforms and "cpu" not in platforms.lower().split(","):
        return f"JAX_PLATFORMS={platforms!r} leaves out the CPU"
    try:
        from jax._src import xla_bridge
    except ImportError:  # a JAX without the module: do not guess
        return "this JAX does not say whether its backends started"
    if xla_bridge.backends_are_initialized():
        return "JAX's backends were already running when dew.train was imported"
    return None


def intra_op_threads(devices: int) -> int:
    """Threads of XLA:CPU's intra-op pool for ``devices`` CPU devices: the cores, and at
    least ``devices + 1``.

    A device waiting in an all-reduce for the others holds one thread of the pool; a
    matrix product waits on a barrier for its share of tasks in the same pool. With as
    many threads as devices on 2 cores, one device waiting in the all-reduce and the
    other's product waiting for a task queued behind it wait for each other until XLA
    stops the process (its rendezvous termination timeout, 40 s); measured: a
    hand-written loop over 2 devices on 2 cores did so in 6 runs of 6, and ran with a
    pool of 3. Set through ``NPROC``, which XLA reads when JAX starts its CPU backend.
    """
    return max(available_cores(), devices + 1)


def configure_cpu_devices() -> dict:
    """Apply ``DEW_CPU_DEVICES`` once per process; returns what was done:
    ``{'requested', 'devices' (the count Dew set, or None), 'why' (when none)}``.
    A bad ``DEW_CPU_DEVICES`` raises ``ValueError``."""
    global _configured
    if _configured is not None:
        return _configured
    choice = requested()
    devices, why = None, None
    if choice == "off":
        why = f"{ENV}=off"
    elif choice == "auto" and available_cores() < AUTO_DEVICES:
        why = f"the process may use {available_cores()} core(s)"
    elif (blocked := _blocked()) is not None:
        why = blocked
    else:
        devices = AUTO_DEVICES if choice == "auto" else choice
        jax.config.update("jax_num_cpu_devices", devices)
        if devices > 1 and not os.environ.get("NPROC"):
            os.environ["NPROC"] = str(intra_op_threads(devices))
    _configured = {"requested": choice, "devices": devices, "why": why}
    return _configured


def split_devices() -> tuple[list, list] | None:
    """``(every device, one device per process)`` when the devices are the CPU devices
    Dew's ``auto`` asked for, else None (the trainer's mesh is then the user's as ever)."""
    done = configure_cpu_devices()
    if done["requested"] != "auto" or done["devices"] is None:
        return None
    devices = jax.devices()
    if devices[0].platform != "cpu" or jax.local_device_count() != done["devices"]:
        return None
    first = {}
    for d in devices:
        first.setdefault(d.process_index, d)
    return devices, list(first.values())


def step_flops_estimate(init_jaxpr, rows: int) -> float:
    """A training step's matrix-product FLOPs estimated from the objective's init
    (:func:`dew.train.throughput.program_flops` of its jaxpr): every objective's
    ``init`` runs its model forward on one example, so the forward's FLOPs per
    example times ``rows``, times 3 (forward and backward)."""
    return 3.0 * program_flops(init_jaxpr) * rows


def choose(flops: float, rows: int, count: int) -> tuple[bool, str, bool]:
    """Whether ``auto`` splits a step of ``flops`` over ``count`` CPU devices, why, and
    whether the trainer prints it: a split, or a large step whose batch does not
    divide; a small step stays on one device silently (the start line shows it)."""
    estimate = f"~{flops / 1e9:.2g} GFLOP a step"
    if flops < SPLIT_FROM_FLOPS:
        why = (
            f"CPU split ({ENV}=auto): {estimate}, under {SPLIT_FROM_FLOPS / 1e9:g} GFLOP; "
            f"the step runs on one device"
        )
        return False, why, False
    if rows % count:
        why = (
            f"CPU split ({ENV}=auto): {estimate}, but the batch of {rows} rows does not "
            f"divide over {count} devices; the step runs on one device (use a multiple of "
            f"{count} rows to split it)"
        )
        return False, why, True
    return True, f"CPU split ({ENV}=auto): {estimate}, split over {count} CPU devices", True
