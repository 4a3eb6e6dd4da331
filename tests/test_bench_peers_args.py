"""tools/bench_peers/run.py: bad command lines stop before any side runs, with a
message naming the value and the accepted ones; a missing peer interpreter is
reported as not installed (argument parsing and the table only: nothing is
trained here, well under a second)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def run(load_tool):
    return load_tool("bench_peers/run.py")


def error(run, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        run.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_unknown_size_names_it_and_the_accepted_ones(run, capsys):
    message = error(run, ["--sizes", "seed", "huge"], capsys)
    assert "unknown size 'huge'" in message and "['seed', 'medium']" in message


def test_unknown_side_names_it_and_the_accepted_ones(run, capsys):
    message = error(run, ["--sides", "dew", "jaxformer"], capsys)
    assert "unknown side 'jaxformer'" in message and "'tunix'" in message
    assert "'levanter'" in message and "'maxtext'" in message


def test_venv_path_that_does_not_exist(run, capsys, tmp_path):
    missing = tmp_path / "nope" / "bin" / "python"
    message = error(run, ["--venv", f"tunix={missing}"], capsys)
    assert f"no interpreter at '{missing}'" in message and "tunix_side.py" in message
    message = error(run, ["--venv", f"flaxformer={missing}"], capsys)
    assert "SIDE=PYTHON" in message and "'maxtext'" in message


def test_venv_that_exists_is_used(run, tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    args = run.parse_args(["--sizes", "seed", "--venv", f"maxtext={python}"])
    assert args.sizes == ["seed"] and args.pythons["maxtext"] == str(python)
    assert args.pythons["tunix"] == "/work/peers/tunix/bin/python"  # the default, untouched


def test_missing_interpreter_is_reported_not_dropped(run, tmp_path):
    out = run.run_side("levanter", str(tmp_path / "python"), "seed", 2, 10)
    assert out.startswith("not installed") and "levanter_side.py" in out
    rows = run.table("seed", {"dew": [], "levanter": [out]})
    assert any("| levanter | not installed" in row for row in rows)


def test_bench_matmul_refuses_a_size_below_one_and_reports_a_missing_torch(
    tmp_path, capsys, load_tool
):
    module = load_tool("bench_matmul.py")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--size", "0"])
    assert exit_.value.code == 2
    assert "--size 0" in capsys.readouterr().err
    missing = str(tmp_path / "no-venv" / "python")
    assert module.run(missing, "torch", 8, 1) == f"not installed (no {missing})"


def test_bench_attention_refuses_a_length_that_does_not_divide_the_tokens(
    tmp_path, capsys, load_tool
):
    module = load_tool("bench_attention.py")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--lengths", "256", "300"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--lengths 300" in err and "--tokens 4096" in err
    with pytest.raises(SystemExit):
        module.main(["--step", "one", "two"])
    assert "--step 'two': use 'one', 'auto' or a block count >= 1" in capsys.readouterr().err
    missing = str(tmp_path / "no-venv" / "python")
    assert module.run(missing, "torch", 16, 256) == f"not installed (no {missing})"


def test_table_pairs_training_rates_round_by_round(run):
    """The by-round column: Dew's rate over the side's within each round, a failed
    round left out, the median first; the ratio of medians beside it."""
    dew = [{"tokens_per_s": t, "first_step_s": 10.0, "gen_tokens_per_s": 100.0,
            "peak_rss_mib": 1.0} for t in (100.0, 300.0, 200.0)]  # fmt: skip
    torch = [{**dew[0], "tokens_per_s": 50.0}, "failed (rc 1): oops",
             {**dew[0], "tokens_per_s": 400.0}]  # fmt: skip
    assert run.paired_ratios(dew, torch) == [2.0, 0.5]
    lines = run.table("seed", {"dew": dew, "torch": torch})
    row = next(x for x in lines if "| torch |" in x).split(" | ")
    # ratio of medians: 200 / median(50, 400) = 200 / 225; by round: median(2.0, 0.5)
    assert row[3] == f"{200 / 225:.2f}x" and row[4] == "1.25x (2.00, 0.50)"
    assert "| dew | 200 | (ref) |  |" in next(x for x in lines if "| dew |" in x)
