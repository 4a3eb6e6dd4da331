"""The seed's program, examples/quickstart.py, is the users' page's program unchanged (its
run and printed lines are checked in tests/packaging/test_examples.py, from a fresh
clone with the README's command)."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_is_the_seed_program_unchanged():
    seed = ROOT.parent / "shared" / "key-concepts.md"
    if not seed.exists():
        pytest.skip("shared/key-concepts.md is not beside this checkout")
    text = seed.read_text()
    program = text[text.index("import itertools") : text.index("On four cores")].strip()
    assert (ROOT / "examples/quickstart.py").read_text().strip() == program
