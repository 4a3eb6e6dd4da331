"""The package graph of DESIGN.md, enforced on the sources: no package imports
one above it, and every third-party import is a declared dependency."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from _workspace import packages  # noqa: E402

# subpackage -> the dew subpackages it may import (DESIGN.md)
ALLOWED = {
    "nn": set(),
    "data": set(),
    "sampling": {"nn", "data"},
    "objectives": {"nn", "sampling", "data"},
    "train": {"nn", "data", "objectives", "sampling"},
}
# import name -> distribution name
DISTRIBUTIONS = {
    "jax": "jax",
    "flax": "flax",
    "numpy": "numpy",
    "optax": "optax",
    "orbax": "orbax-checkpoint",
    "grain": "grain",
    "tensorboardX": "tensorboardx",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "datasets": "datasets",
    "PIL": "pillow",
    "pyarrow": "pyarrow",
    "jaxlib": "jax",
}


def imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def sources(sub: str):
    return sorted((ROOT / f"packages/dew-{sub}/src/dew/{sub}").rglob("*.py"))


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_no_upward_imports(sub):
    bad = []
    for path in sources(sub):
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "dew" and len(parts) > 1 and parts[1] != sub:
                if parts[1] not in ALLOWED[sub]:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "imports against the package graph:\n" + "\n".join(bad)


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_third_party_imports_are_declared(sub):
    info = packages(ROOT)[f"dew-{sub}"]
    declared = set()
    for req in info["requires"]:
        declared.add(req.name)
    import tomllib

    project = tomllib.loads((info["dir"] / "pyproject.toml").read_text())["project"]
    for extra in project.get("optional-dependencies", {}).values():
        declared.update(r.split(">")[0].split("<")[0].split("=")[0].split("[")[0] for r in extra)
    dew_deps = {d.removeprefix("dew-") for d in declared if d.startswith("dew-")}
    stdlib = sys.stdlib_module_names
    undeclared = []
    for path in sources(sub):
        for name in imports(path):
            top = name.split(".")[0]
            if top in stdlib or top == "__future__":
                continue
            if top == "dew":
                parts = name.split(".")
                if len(parts) > 1 and parts[1] != sub and parts[1] not in dew_deps:
                    undeclared.append(f"{path.relative_to(ROOT)}: {name} (add dew-{parts[1]})")
                continue
            dist = DISTRIBUTIONS.get(top)
            if dist is None or dist not in declared:
                undeclared.append(f"{path.relative_to(ROOT)}: {name} (distribution {dist or top})")
    assert not undeclared, "imports not declared in pyproject.toml:\n" + "\n".join(undeclared)


@pytest.mark.parametrize("sub", sorted(ALLOWED))
def test_every_declared_dependency_is_imported(sub):
    info = packages(ROOT)[f"dew-{sub}"]
    imported = set()
    for path in sources(sub):
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "dew" and len(parts) > 1:
                imported.add(f"dew-{parts[1]}")
            elif parts[0] in DISTRIBUTIONS:
                imported.add(DISTRIBUTIONS[parts[0]])
    unused = sorted(r.name for r in info["requires"] if r.name not in imported)
    assert not unused, f"dew-{sub} declares dependencies it never imports: {unused}"
