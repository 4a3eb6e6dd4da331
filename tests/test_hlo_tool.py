"""tools/_hlo.py, the benchmarks' ``--hlo`` lines: shape sizes, and the copies of a
donated buffer that is still read after an in-place write (one tiny compile each)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def hlo(load_tool):
    return load_tool("_hlo.py")


def test_shape_bytes(hlo):
    assert hlo.shape_bytes("f32[256,1024]{1,0}") == 256 * 1024 * 4
    assert hlo.shape_bytes("(bf16[3,5], pred[7], s32[])") == 30 + 7 + 4
    assert hlo.shape_bytes("f64[2]") == 16


def update(select: bool):
    def step(p, m, g):
        new_m = 0.9 * m + g
        new_p = p - new_m / (jnp.sqrt(new_m**2) + 1e-8)
        if not select:
            return new_p, new_m
        ok = jnp.isfinite(jnp.sum(g))
        return jnp.where(ok, new_p, p), jnp.where(ok, new_m, m)

    x = jnp.ones((64, 32))
    return jax.jit(step, donate_argnums=(0, 1)).lower(x, x, x).compile()


def test_a_select_of_a_donated_moment_costs_a_copy_and_the_line_says_so(hlo):
    plain, guarded = hlo.traffic(update(False)), hlo.traffic(update(True))
    assert (plain["copies"], plain["copy_bytes"]) == (0, 0)
    # the weights' fusion recomputes the moment from the old buffer, which the
    # moment's own in-place select overwrites: XLA copies it first
    assert (guarded["copies"], guarded["copy_bytes"]) == (1, 64 * 32 * 4)
    assert guarded["flops"] > 0 and guarded["bytes_accessed"] > plain["bytes_accessed"]
    line = hlo.compare("update", update(True), update(False))
    assert "entry copies dew 1 (0.0 MiB) hand 0 (0.0 MiB)" in line


def test_hlo_dir_keeps_both_programs_text(hlo, tmp_path, monkeypatch):
    monkeypatch.setenv("HLO_DIR", str(tmp_path))
    guarded, plain = update(True), update(False)
    hlo.compare("update", guarded, plain)
    assert (tmp_path / "update_dew.hlo.txt").read_text() == guarded.as_text()
    assert (tmp_path / "update_hand.hlo.txt").read_text() == plain.as_text()
