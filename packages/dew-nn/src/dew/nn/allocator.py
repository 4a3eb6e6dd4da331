"""The host memory allocator setting Dew applies on CPU: glibc ``mallopt``.

XLA's CPU backend allocates its large temporaries (activations, gradients,
optimizer updates: megabytes each) with ``malloc``. glibc serves every
allocation above ``M_MMAP_THRESHOLD`` (128 KiB to 32 MiB, adapting) with a
fresh ``mmap`` and gives it back with ``munmap`` on ``free``, so each
training step page-faults its whole working set in again. Three settings
keep freed memory in the heap for the next step instead:

- ``M_MMAP_MAX = 0``: never serve an allocation with its own ``mmap``;
- ``M_TRIM_THRESHOLD = -1``: never give the top of the heap back (``sbrk``);
- ``M_ARENA_MAX = 1``: one arena, so memory freed by one XLA thread is reused
  by the next, whichever thread allocates.

Measured on the medium LM (docs/performance.md): the step is ~1.6x faster.
The price: the process's resident memory stays at its high-water mark.

:func:`configure_allocator` applies them once per process, only where that is
safe and useful: Linux with glibc, and no other allocator (tcmalloc,
jemalloc, mimalloc) preloaded or linked in, which has its own policy. It runs
when ``dew.train`` or ``dew.sampling`` is imported, before any large
allocation. The environment variable ``DEW_ALLOCATOR`` chooses:

- ``tuned`` (the default; also when unset or empty): apply the settings;
- ``system``: leave the C library's allocator as it is.

Any other value is an error naming the accepted ones.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "DEW_ALLOCATOR"
CHOICES = ("tuned", "system")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

# glibc's malloc.h parameter numbers
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

_applied: str | None = None


def requested() -> str:
    """The value of ``DEW_ALLOCATOR`` (``'tuned'`` when unset or empty), checked."""
    value = os.environ.get(ENV, "").strip().lower() or "tuned"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not understood; use one of {list(CHOICES)} "
            f"('tuned' = Dew's glibc malloc setting, the default; 'system' = leave the "
            f"C library's allocator as it is), or unset it"
        )
    return value


def other_allocator() -> str | None:
    """The name of a non-glibc allocator preloaded or mapped into this process, if any."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return name
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    for name in OTHER_ALLOCATORS:
        if f"lib{name}" in maps:
            return name
    return None


def configure_allocator() -> str:
    """Apply the allocator setting ``DEW_ALLOCATOR`` asks for, once per process.

    Returns what was done: ``'tuned'``, ``'system'`` (opted out), or
    ``'skipped: <why>'`` (not Linux/glibc, another allocator loaded, or
    ``mallopt`` refused). A bad ``DEW_ALLOCATOR`` raises ``ValueError``.
    """
    global _applied
    if _applied is not None:
        return _applied
    choice = requested()
    if choice == "system":
        _applied = "system"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        _applied = f"skipped: {platform.system()} {platform.libc_ver()[0] or 'libc'} is not glibc"
    elif (other := other_allocator()) is not None:
        _applied = f"skipped: {other} is loaded"
    else:
        _applied = _mallopt()
    return _applied


def _mallopt() -> str:
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as error:
        return f"skipped: no glibc mallopt ({error})"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success
    done = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, -1), mallopt(M_ARENA_MAX, 1)]
    return "tuned" if all(done) else f"skipped: mallopt returned {done}"
