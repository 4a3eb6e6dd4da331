"""The glibc allocator setting: applied by default, opt-out by environment, a bad
value a clear error; checked on glibc's own counters (mallinfo2)."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys

import pytest

from dew.nn import allocator

MODULE = pathlib.Path(allocator.__file__)

# Loads allocator.py alone (no jax), applies it, then allocates 64 MiB and
# reports how many more bytes glibc holds in mmapped chunks (mallinfo2().hblkhd).
PROGRAM = f"""
import ctypes, importlib.util
spec = importlib.util.spec_from_file_location("allocator", {str(MODULE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.configure_allocator())

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
before = libc.mallinfo2().hblkhd
block = libc.malloc(64 << 20)
print(libc.mallinfo2().hblkhd - before)
libc.free(ctypes.c_void_p(block))
"""


def run(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (allocator.ENV, "LD_PRELOAD")}
    if value is not None:
        env[allocator.ENV] = value
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_tuned_by_default_and_system_opts_out():
    tuned, system = run(None), run("system")
    assert tuned.returncode == 0 and system.returncode == 0, tuned.stderr + system.stderr
    applied, mmapped = tuned.stdout.split()
    assert applied == "tuned"
    assert int(mmapped) == 0  # the 64 MiB block came from the heap, not its own mmap
    applied, mmapped = system.stdout.split()
    assert applied == "system"
    assert int(mmapped) >= 64 << 20  # glibc's default: a block this large is mmapped


def test_unknown_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "fast")
    with pytest.raises(ValueError, match=r"DEW_ALLOCATOR='fast'.*\['tuned', 'system'\]"):
        allocator.requested()
    monkeypatch.setenv(allocator.ENV, " System ")
    assert allocator.requested() == "system"
    monkeypatch.delenv(allocator.ENV)
    assert allocator.requested() == "tuned"


def test_another_allocator_is_left_alone(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert allocator.other_allocator() == "tcmalloc"
