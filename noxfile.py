"""Dew's test matrix. `nox -l` lists it; a bare `nox` runs every default session.

Each package session installs only that package and its declared, lock-pinned
dependencies (`uv sync --locked --package <pkg>`) and runs its tests on 8
emulated CPU devices with pytest-xdist.
"""

from __future__ import annotations

import os
import pathlib

import nox

ROOT = pathlib.Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.download_python = "never"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "integration", "docs", "lint", "wheels", "parity"]

PYTHON = "3.11"
PACKAGES = {
    "dew_nn": ("dew-nn", ["--all-extras"]),
    "dew_data": ("dew-data", ["--all-extras"]),
    "dew_sampling": ("dew-sampling", []),
    "dew_objectives": ("dew-objectives", []),
    "dew_train": ("dew-train", ["--all-extras"]),  # wandb, mlflow: the tracker tests
    "dew": ("dew-jax", []),
}
PACKAGE_DIRS = {"dew-jax": "dew"}

ENV = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "JAX_PLATFORMS": "cpu",
    # One persistent compilation cache for every session and run on this machine.
    "JAX_COMPILATION_CACHE_DIR": os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/dew/jax-compilation")
    ),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "UV_COMPILE_BYTECODE": "1",
    "PYTHONDONTWRITEBYTECODE": "",
}
PYTEST = ["pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"]


def sync(session: nox.Session, *args: str) -> None:
    """`uv sync --locked` into this session's venv (lock-pinned, bytecode compiled)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--compile-bytecode",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        silent=True,
    )


@nox.session(python=PYTHON, tags=["packages"])
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package alone: its declared dependencies only, its own tests."""
    dist, extras = PACKAGES[package]
    sync(session, "--package", dist, *extras)
    folder = PACKAGE_DIRS.get(dist, dist)
    if dist == "dew-data":
        # dew-data must work without jax: fail loudly if something pulled it in.
        session.run(
            "python",
            "-c",
            "import importlib.util as u, sys; "
            "sys.exit('jax is installed in the dew-data session' if u.find_spec('jax') "
            "else 0)",
        )
    session.run(*PYTEST, f"packages/{folder}/tests", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Cross-package tests: the quickstart, resume after SIGKILL, several processes."""
    sync(session, "--all-packages", "--all-extras")
    session.run(
        *PYTEST,
        "tests",
        "--ignore=tests/packaging",
        "--ignore=tests/test_docs.py",
        *session.posargs,
        env=ENV,
    )


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Every ```python block in docs/*.md runs."""
    sync(session, "--all-packages", "--all-extras")
    session.run(*PYTEST, "tests/test_docs.py", *session.posargs, env=ENV)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check, and sibling version ranges."""
    sync(session, "--only-group", "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "tools/check_ranges.py")


@nox.session(python=PYTHON)
def wheels(session: nox.Session) -> None:
    """Build every wheel; install dew-nn alone, dew-data alone, then all of them (uv);
    then the umbrella with plain pip from the wheels folder (`pip install --find-links
    dist dew-jax`, as packages/dew/README.md says): no datasets/pandas/pyarrow, and
    it trains a tiny model."""
    sync(session, "--only-group", "packaging")
    session.run(*PYTEST[:2], "tests/packaging", *session.posargs, env=ENV)


@nox.session(python=PYTHON, venv_backend="virtualenv")
def parity(session: nox.Session) -> None:
    """Hugging Face parity: transformers + torch (CPU) beside dew-sampling.

    pip, not uv, installs torch: pip on these machines takes a local CPU wheel,
    uv would download a CUDA build of several GB.
    """
    requirements = session.create_tmp() + "/requirements.txt"
    session.run_install(
        "uv",
        "export",
        "--locked",
        "--package",
        "dew-train",  # everything dew-sampling needs, and the trainer (LoRA round trips)
        "--no-hashes",
        "--no-emit-workspace",
        "--no-header",
        "--no-annotate",
        "-o",
        requirements,
        silent=True,
        external=True,
    )
    session.install("-q", "-r", requirements)
    session.install("-q", "torch==2.13.0", "transformers>=5", "diffusers", "peft", "safetensors")
    session.install(
        "-q",
        "--no-deps",
        "./packages/dew-nn",
        "./packages/dew-data",
        "./packages/dew-sampling",
        "./packages/dew-objectives",
        "./packages/dew-train",
    )
    session.run(*PYTEST, "packages/dew-sampling/tests/parity", *session.posargs, env=ENV)


@nox.session(python=PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks (not tests): Dew against hand-written loops, side by side."""
    sync(session, "--all-packages", "--all-extras")
    env = {k: v for k, v in ENV.items() if k != "XLA_FLAGS"}
    for script in sorted(pathlib.Path("tools").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs, env=env)


if __name__ == "__main__":  # pragma: no cover
    os.execvp("nox", ["nox", "-f", __file__])
