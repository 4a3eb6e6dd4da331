"""The README gives exactly two commands, and CI runs the test one verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def commands():
    text = (ROOT / "README.md").read_text()
    return [b.strip() for b in re.findall(r"^```\n(.*?)^```", text, re.S | re.M)]


def test_readme_has_exactly_two_commands():
    quickstart, tests = commands()
    assert "examples/quickstart.py" in quickstart
    assert tests.endswith("nox")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci/run").read_text()
    assert f"bash -c '{commands()[1]}'" in ci


def test_readme_versions_match_the_packages():
    import tomllib

    text = (ROOT / "README.md").read_text()
    for pyproject in (ROOT / "packages").glob("*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        row = next(line for line in text.splitlines() if f"`{project['name']}`" in line)
        assert f"| {project['version']} |" in row, (project["name"], row)


def test_readme_links_every_guide():
    text = (ROOT / "README.md").read_text()
    guides = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    missing = [name for name in guides if f"](docs/{name})" not in text]
    assert not missing, f"README.md does not link these guides in docs/: {missing}"
