"""tools/_trace.py, the device time per HLO category that profile_tpu_step.py and the
RL benchmarks' ``--trace`` print, read off a trace written here by hand."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def trace(load_tool):
    return load_tool("_trace.py")


def write_trace(directory, events):
    folder = directory / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Modules"}},
    ]
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def op(name, category, ts, dur, pid=2, tid=7):
    args = {"hlo_category": category, "long_name": f"%{name} = f32[8] fusion()"}
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def test_categories_are_the_device_s_time_a_step(tmp_path, trace, capsys):
    # two steps: per step 3 us of loop fusion (1 + 2) and 4 us of copies; the host's
    # operation and the module span are not operations of the device
    events = [
        op("fusion.1", "loop fusion", 0, 1000),
        op("fusion.2", "loop fusion", 1000, 2000),
        op("copy.3", "copy-done", 3000, 4000),
        op("fusion.1", "loop fusion", 10000, 1000),
        op("fusion.2", "loop fusion", 11000, 2000),
        op("copy.3", "copy-done", 13000, 4000),
        op("fusion.9", "loop fusion", 0, 50000, pid=1),
        op("jit_step", "", 0, 7000, tid=8),
        op("jit_step", "", 10000, 7000, tid=8),
    ]
    write_trace(tmp_path, events)
    got = trace.summarize(str(tmp_path), "step", steps=2, top=2, per_category=1)
    assert got == pytest.approx({"loop fusion": 3.0, "copy-done": 4.0})
    out = capsys.readouterr().out
    assert "module jit_step 7.00 ms, then idle 3.00 ms" in out
    assert "   ops total 7.00 ms/step" in out
    assert "copy.3" in out and "fusion.2" in out and "fusion.1 " not in out  # top 2 only
    # then each category's longest operation, the largest category first
    lines = [line for line in out.splitlines() if line.startswith("   [")]
    assert [line.split()[0] for line in lines] == ["[copy-done]", "[loop"]
    assert "4.000 ms  x1    copy.3" in lines[0] and "2.000 ms  x1    fusion.2" in lines[1]


def test_no_trace_is_an_empty_summary(tmp_path, trace, capsys):
    assert trace.summarize(str(tmp_path), "step", steps=1) == {}
    assert "no trace file" in capsys.readouterr().out


def test_compare_lists_the_largest_difference_first(trace):
    text = trace.compare(
        ("dew", {"loop fusion": 11.9, "copy-done": 1.9}),
        ("hand", {"loop fusion": 4.66, "copy-done": 2.71, "sort": 0.01}),
    )
    lines = text.splitlines()
    assert lines[1] == "  loop fusion: 11.900 | 4.660 | +7.240"
    assert lines[2] == "  copy-done: 1.900 | 2.710 | -0.810"
    assert lines[3] == "  sort: 0.000 | 0.010 | -0.010"
    assert lines[-1] == "  total: 13.800 | 7.380 | +6.420"


def test_trace_pair_threads_each_program_s_carry(tmp_path, trace):
    # on the CPU the trace holds no device, so the comparison is empty; the carries
    # must still thread through every call (a donated state used once)
    step = jax.jit(lambda x, y: (x + y, x * 0), donate_argnums=0)
    seen = []

    def counted(x, y):
        seen.append(float(x))
        return step(x, y)

    text = trace.trace_pair(
        str(tmp_path),
        ("a", counted, (jnp.float32(0),), (1.0,)),
        ("b", counted, (jnp.float32(10),), (2.0,)),
    )
    assert seen == [0.0, 1.0, 2.0, 3.0, 10.0, 12.0, 14.0, 16.0]
    assert text.splitlines()[0] == "ms a step by category: a | b | difference"
