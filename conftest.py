"""Repo-wide pytest setup. Stdlib only: every package's isolated session loads it,
and dew-data's has no jax."""

import os

# 8 emulated CPU devices, set before any test imports jax (each xdist worker too).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/dew/jax-compilation")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
