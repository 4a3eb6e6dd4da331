"""Dew's test matrix. `nox -l` lists it; a bare `nox` runs every default session.

Each package session installs only that package and its declared, lock-pinned
dependencies (`uv sync --locked --package <pkg>`) and runs its tests on 8
emulated CPU devices with pytest-xdist.

Pythons: the package sessions run on 3.11 and on the newest supported Python found
(3.13, else 3.12), whose lock fork has the newest JAX. A bare `nox` runs every package
alone on 3.11 and, on the newest Python, a cheap subset (`newest`: NEWEST_TESTS);
`nox -s tests` runs the full matrix, `nox -s tests -p 3.13` the newest Python alone. A
Python that is not installed is skipped and named in the summary, not an error.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import nox

ROOT = pathlib.Path(__file__).parent
nox.options.default_venv_backend = "uv"
nox.options.download_python = "never"
nox.options.reuse_venv = "yes"
# CI machines may have one Python: skip a missing one (named in the summary), even on CI.
nox.options.error_on_missing_interpreters = False

PYTHON = "3.11"  # the oldest supported Python: every session runs on it
NEWER = ("3.13", "3.12")  # requires-python and the classifiers: 3.11 to 3.13


def _select_pyenv_versions() -> None:
    """pyenv's shims answer only for the selected versions (`python3.13: command not
    found` while 3.13 is installed): add every installed supported one to the selection
    for this run. nox started through a shim inherits `PYENV_VERSION` (the version the
    shim resolved, e.g. 3.11.7): that is the current selection, extended the same way."""
    if not shutil.which("pyenv"):
        return
    try:
        ask = dict(capture_output=True, text=True, timeout=20, check=True)
        selected = os.environ.get("PYENV_VERSION") or (
            subprocess.run(["pyenv", "version-name"], **ask).stdout.strip()
        )
        installed = subprocess.run(["pyenv", "versions", "--bare", "--skip-aliases"], **ask)
    except (OSError, subprocess.SubprocessError):
        return
    current = [v for v in selected.split(":") if v]
    supported = (PYTHON, *NEWER)
    extra = [
        v
        for v in installed.stdout.split()
        if re.fullmatch(r"3\.\d+\.\d+", v) and v.rsplit(".", 1)[0] in supported
    ]
    extra = [v for v in extra if v not in current]
    if extra:
        os.environ["PYENV_VERSION"] = ":".join([*current, *extra])


def _runs(version: str) -> bool:
    exe = shutil.which(f"python{version}")
    try:
        return exe is not None and subprocess.run([exe, "-c", ""], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_select_pyenv_versions()
NEWEST = next((v for v in NEWER if _runs(v)), None)
if NEWEST is None:
    NEWEST = NEWER[0]
    print(
        f"noxfile: no Python {' or '.join(NEWER)} found; the {NEWEST} sessions are skipped "
        f"(install one of them on PATH to run the newest JAX too)",
        file=sys.stderr,
    )
nox.options.sessions = [
    f"tests-{PYTHON}",
    "newest",
    "integration",  # tests/test_docs.py included: the docs file shares the two workers
    "lint",
    "wheels",
    "parity",
    "browser",
]

PACKAGES = {
    "dew_nn": ("dew-nn", ["--all-extras"]),
    "dew_data": ("dew-data", ["--all-extras"]),
    "dew_sampling": ("dew-sampling", []),
    "dew_objectives": ("dew-objectives", []),
    "dew_train": ("dew-train", ["--all-extras"]),  # wandb, mlflow: the tracker tests
    "dew": ("dew-jax", []),
}
PACKAGE_DIRS = {"dew-jax": "dew"}

# XLA:CPU settings that compile the tests' programs faster (most of CI's time is XLA:CPU
# compiling tiny programs): LLVM at O1 (XLA's default is O3) and one codegen split
# (default 32); on jax 0.10 (Python 3.11) also the loop emitters for fusions instead of
# the MLIR fusion emitters (XLA in jax 0.12 has only the latter, and refuses the flag).
# Measured from an empty compilation cache on 2 cores (2026-12-07, jax 0.10.2):
# dew-objectives' test_ppo.py 111 -> 54 s, test_jepa.py + dew-nn's test_fused_attention.py
# 272 -> 181 s; the dew-nn session 12-16 -> 8 min. The values can move in their last bits
# against XLA's defaults (each test's tolerance holds; the bit-for-bit tests compare two
# programs compiled alike, and test_startup.py restores XLA's defaults for its own check).
# `nox -s bench` runs without them.
CI_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_parallel_codegen_split_count=1"
LOOP_EMITTERS = "--xla_cpu_use_fusion_emitters=false"  # jax 0.10's XLA only
ENV = {
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {CI_XLA_FLAGS} {LOOP_EMITTERS}",
    "JAX_PLATFORMS": "cpu",
    # One persistent compilation cache for every session and run on this machine.
    "JAX_COMPILATION_CACHE_DIR": os.environ.get(
        "JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/dew/jax-compilation")
    ),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "UV_COMPILE_BYTECODE": "1",
    "PYTHONDONTWRITEBYTECODE": "",
}


def env(session: nox.Session) -> dict[str, str]:
    """ENV for this session's Python: the loop emitters' flag on PYTHON (jax 0.10) alone."""
    if session.python == PYTHON:
        return ENV
    return ENV | {"XLA_FLAGS": ENV["XLA_FLAGS"].replace(f" {LOOP_EMITTERS}", "")}


# --durations: each session's 15 slowest tests in the CI log (the CI-time budget)
PYTEST = ["pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
          "--durations=15"]  # fmt: skip


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


@nox.session(python=[PYTHON, NEWEST], tags=["packages"])
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
    session.run(*PYTEST, f"packages/{folder}/tests", *session.posargs, env=env(session))


# The newest Python's share of a bare `nox` (CI: <= 3 min on 2 cores): one venv, the tests not
# marked slow of the modules that touch what moves between JAX versions (the model registry,
# qwix LoRA, decoding, the trainer, Orbax + Grain checkpoints, the initialisation compiled at
# XLA:CPU O1 equal to the default bit for bit) and the two light packages.
NEWEST_TESTS = [
    "packages/dew-data/tests",
    "packages/dew-nn/tests/test_models.py",
    "packages/dew-nn/tests/test_lora.py",
    "packages/dew-sampling/tests/test_generate.py",
    "packages/dew-train/tests/test_trainer.py",
    "packages/dew-train/tests/test_checkpoints.py",
    "packages/dew-train/tests/test_startup.py",
    "packages/dew/tests",
]


@nox.session(python=NEWEST, tags=["packages"])
def newest(session: nox.Session) -> None:
    """Newest Python and JAX, a cheap check: NEWEST_TESTS not marked slow, in one venv.

    `nox -s tests -p 3.13` runs each package alone, in full, on the newest Python.
    """
    sync(session, "--all-packages", "--all-extras")
    session.run(*PYTEST, "-m", "not slow", *NEWEST_TESTS, *session.posargs, env=env(session))


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Cross-package tests: the quickstart, resume after SIGKILL, several processes, and
    every ```python block in docs/*.md (tests/test_docs.py, which alone is `nox -s docs`).

    One pytest run for both, `--dist loadscope`: each module is one unit of work, as
    with loadfile, and each docs page one of its own (a class in tests/test_docs.py)."""
    sync(session, "--all-packages", "--all-extras")
    # loadscope: a module's functions on one worker (as loadfile), and each docs page,
    # a class of tests/test_docs.py, a unit of its own
    pytest = ["loadscope" if a == "loadfile" else a for a in PYTEST]
    session.run(*pytest, "tests", "--ignore=tests/packaging", "--ignore=tests/browser",
                *session.posargs, env=ENV)  # fmt: skip


@nox.session(python=PYTHON)
def browser(session: nox.Session) -> None:
    """`dew report`'s page in a real headless browser: Qt WebEngine (Chromium's engine,
    the PyQt6-WebEngine wheel from PyPI, offscreen; no system browser needed)."""
    sync(session, "--package", "dew-jax", "--extra", "report")
    session.run_install(
        "uv",
        "pip",
        "install",
        "-q",
        "PyQt6-WebEngine==6.11.0",
        env={"VIRTUAL_ENV": session.virtualenv.location},
        silent=True,
    )
    session.run(*PYTEST[:2], "-p", "no:cacheprovider", "tests/browser", *session.posargs, env=ENV)


@nox.session(python=PYTHON, default=False)
def docs(session: nox.Session) -> None:
    """Every ```python block in docs/*.md runs (also part of `integration`)."""
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
    it trains a tiny model. Also every example as its header documents it, in a fresh
    clone (tests/packaging/test_examples.py), and the READMEs against what ships."""
    sync(session, "--only-group", "packaging")
    # two workers, test by test (not file by file: the wheel tests are one file and
    # most of the time); each worker builds the wheels once (a module fixture, < 1 s)
    session.run(
        *PYTEST[:2], "-n", "2", "--dist", "load", "tests/packaging", *session.posargs, env=ENV
    )


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
    session.install(
        "-q", "torch==2.13.0", "transformers>=5", "diffusers", "peft", "safetensors", "trl"
    )
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
