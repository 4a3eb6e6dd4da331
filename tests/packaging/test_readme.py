"""The README gives exactly two commands, and CI runs the test one verbatim; it and the
package READMEs name what ships."""

import json
import pathlib
import re

import pytest

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


# What ships, asked of a fresh install (conftest.py's clone): the model registry, every
# public module of dew.objectives with the Objective classes it defines, the dew.data
# readers (a `.load`), the dew.sampling pipelines (a `.save`), diffusion samplers and
# noise schedules, the Hugging Face formats, and the umbrella's re-exports.
INVENTORY = """
import importlib, inspect, json, pkgutil
import dew, dew.data, dew.objectives, dew.sampling
from dew.nn import hf, models
from dew.objectives import Objective

def classes(package, keep):
    found = (getattr(package, n) for n in package.__all__)
    return sorted(c.__name__ for c in found if inspect.isclass(c) and keep(c))

objectives = {}
for info in pkgutil.walk_packages(dew.objectives.__path__, "dew.objectives."):
    if not info.ispkg and not any(p.startswith("_") for p in info.name.split(".")):
        module = importlib.import_module(info.name)
        objectives[info.name] = sorted(
            name for name, c in vars(module).items()
            if inspect.isclass(c) and issubclass(c, Objective) and c is not Objective
            and c.__module__ == module.__name__
        )
samplers = ("dew.sampling.diffusion.samplers", "dew.sampling.diffusion.schedules")
print(json.dumps({
    "umbrella": dew.__all__,
    "models": models.names(),
    "formats": sorted(hf.names()),
    "objectives": objectives,
    "readers": classes(dew.data, lambda c: hasattr(c, "load")),
    "pipelines": classes(dew.sampling, lambda c: hasattr(c, "save")),
    "samplers": classes(
        dew.sampling, lambda c: c.__module__ in samplers and not issubclass(c, tuple)
    ),
}))
"""


def missing(path: str, names) -> list[str]:
    text = (ROOT / path).read_text()
    return [name for name in names if f"`{name}`" not in text]


@pytest.mark.slow
def test_readmes_name_what_ships(fresh_clone):
    run = fresh_clone.run(["uv", "run", "--locked", "python", "-c", INVENTORY], timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ships = json.loads(run.stdout.splitlines()[-1])
    modules = list(ships["objectives"])
    classes = [c for found in ships["objectives"].values() for c in found]
    assert classes, ships["objectives"]  # the Objective subclasses were found
    wants = {
        "README.md": [
            *ships["models"],
            *ships["formats"],
            *modules,
            *classes,
            *ships["readers"],
            *ships["pipelines"],
            *ships["samplers"],
        ],
        "packages/dew-nn/README.md": [*ships["models"], *ships["formats"]],
        "packages/dew-objectives/README.md": [*modules, *classes],
        "packages/dew-data/README.md": ships["readers"],
        "packages/dew-sampling/README.md": [*ships["pipelines"], *ships["samplers"]],
        "packages/dew/README.md": ships["umbrella"],
    }
    gaps = {path: gap for path, names in wants.items() if (gap := missing(path, names))}
    assert not gaps, f"these READMEs do not name what ships (in backquotes): {gaps}"


def test_readme_names_every_example():
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert not missing("README.md", examples), "README.md's table: name each example"
