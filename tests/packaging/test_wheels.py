"""Built wheels, installed the ways downstream teams install them."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
UV = shutil.which("uv")
pytestmark = pytest.mark.skipif(UV is None, reason="uv is not on PATH")


def run(*args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run(UV, "build", "--all-packages", "--wheel", "-o", str(out), "-q", cwd=ROOT)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    assert len(wheels) == 6, wheels
    return out


def venv(tmp_path, name, *wheels, dist):
    path = tmp_path / name
    run(UV, "venv", "-q", "--python", sys.executable, str(path))
    python = str(path / "bin" / "python")
    files = [str(next(dist.glob(f"{w}-*.whl"))) for w in wheels]
    run(UV, "pip", "install", "-q", "--python", python, "--find-links", str(dist), *files)
    return python


def test_dew_nn_wheel_alone(dist, tmp_path):
    python = venv(tmp_path, "nn", "dew_nn", dist=dist)
    run(
        python,
        "-c",
        textwrap.dedent("""
        import importlib.util, sys
        import jax, jax.numpy as jnp
        from dew.nn import models
        m = models.build("causal_transformer", vocab_size=16, emb_features=8, num_layers=1,
                         num_heads=2, mlp_features=16, max_seq_len=8)
        v = m.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
        assert m.apply(v, jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 16)
        for absent in ("dew.train", "dew.data", "dew.objectives", "dew.sampling"):
            assert importlib.util.find_spec(absent) is None, absent
        assert "orbax" not in sys.modules
    """),
    )


def test_dew_data_wheel_alone_has_no_jax(dist, tmp_path):
    python = venv(tmp_path, "data", "dew_data", dist=dist)
    run(
        python,
        "-c",
        textwrap.dedent("""
        import importlib.util
        from dew.data import ByteTokenizer, Dataset, Partition
        assert importlib.util.find_spec("jax") is None
        t = ByteTokenizer()
        assert t.decode(t.encode("héllo")) == "héllo"
        assert Partition(1, 2).slice(8) == slice(4, 8)
    """),
    )


def test_all_wheels_umbrella_tests_pass(dist, tmp_path):
    python = venv(
        tmp_path,
        "all",
        "dew_jax",
        "dew_nn",
        "dew_data",
        "dew_sampling",
        "dew_objectives",
        "dew_train",
        dist=dist,
    )
    run(UV, "pip", "install", "-q", "--python", python, "pytest")
    # run from a folder without the sources so the installed wheels are what is tested
    tests = tmp_path / "umbrella_tests"
    shutil.copytree(ROOT / "packages/dew/tests", tests)
    run(
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(tests),
        cwd=tmp_path,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/usr/bin:/bin"},
    )


# A text-only language-model install: what `pip install dew-jax` must not bring in.
HEAVY = ("datasets", "pandas", "pyarrow")


@pytest.mark.slow
def test_umbrella_with_plain_pip_from_wheels_trains(dist, tmp_path):
    """The packages README's command, `pip install --find-links dist dew-jax`, with pip
    itself (not uv) in a fresh `python -m venv`: it resolves the five siblings from
    the wheels folder and everything else from the index, then trains."""
    path = tmp_path / "pip"
    run(sys.executable, "-m", "venv", str(path))
    python = str(path / "bin" / "python")
    run(python, "-m", "pip", "install", "-q", "--find-links", str(dist), "dew-jax")
    run(python, "-m", "pip", "check")
    script = textwrap.dedent("""
        import importlib.metadata as md, itertools, json, math, sys
        import numpy as np, optax, jax
        import dew
        from dew import ByteTokenizer, Dataset, Trainer, models
        from dew.objectives.language.lm import LMObjective

        names = {d.metadata["Name"].lower() for d in md.distributions()}
        assert {"dew-jax", "dew-nn", "dew-data", "dew-sampling", "dew-objectives",
                "dew-train"} <= names, sorted(names)
        heavy = sorted(names & set(sys.argv[2].split(",")))
        assert not heavy, f"a text-only install pulled {heavy}"
        assert dew.__file__.startswith(sys.prefix), dew.__file__  # the wheel, not the tree

        tokenizer = ByteTokenizer()
        text = np.asarray(tokenizer.encode("dew trains jax models. " * 3)[:17], np.int32)
        batch = {"text": np.tile(text, (8, 1))}
        data = Dataset(train=lambda p: itertools.repeat(batch), val=None, records=8, batch=8)
        model = models.build("causal_transformer", vocab_size=tokenizer.vocab_size,
                             emb_features=16, num_layers=1, num_heads=2, mlp_features=32,
                             max_seq_len=16)
        trainer = Trainer(LMObjective(model=model, seq_len=16), optax.adam(1e-2),
                          key=jax.random.key(0), run_dir=sys.argv[1], progress=False)
        state = trainer.fit(data, steps=4, log_every=1)
        assert int(state.step) == 4
        rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
        losses = [r["loss"] for r in rows if r["kind"] == "train"]
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
        # one repeated batch: adam lowers the loss from its start near log(vocab)
        assert losses[-1] < losses[0] and abs(losses[0] - math.log(tokenizer.vocab_size)) < 1
    """)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    run(python, "-c", script, str(tmp_path / "run"), ",".join(HEAVY), cwd=tmp_path, env=env)


@pytest.mark.slow
def test_plain_pip_resolves_the_source_folders_with_the_hf_extra(tmp_path):
    """`pip install ./packages/dew` alone cannot work (pip looks for dew-nn on the
    index); the README's form names every sibling folder. pip resolves it (a dry
    run: metadata only), takes each Dew package from its folder, and the umbrella's
    `[hf]` extra reaches dew-data's: datasets, pandas, pyarrow."""
    path = tmp_path / "pip"
    run(sys.executable, "-m", "venv", str(path))
    folders = ["dew-nn", "dew-data", "dew-sampling", "dew-objectives", "dew-train"]
    args = [str(ROOT / "packages" / f) for f in folders] + [f"{ROOT / 'packages/dew'}[hf]"]
    report = tmp_path / "report.json"
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--dry-run"]
    run(*pip, "--ignore-installed", "--report", str(report), *args)
    install = json.loads(report.read_text())["install"]
    sources = {i["metadata"]["name"]: i["download_info"]["url"] for i in install}
    for name, folder in [*zip(folders, folders), ("dew-jax", "dew")]:
        assert sources[name] == (ROOT / "packages" / folder).as_uri(), (name, sources[name])
    assert set(HEAVY) <= set(sources), sorted(sources)
