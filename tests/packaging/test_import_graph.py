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
    "qwix": "qwix",
    "av": "av",
    "xxhash": "xxhash",
    "jinja2": "jinja2",
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


def module_name(path: pathlib.Path, sub: str) -> str:
    relative = path.relative_to(ROOT / f"packages/dew-{sub}/src").with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports by name,
    at the top or inside a function. ``from pkg import mod`` is an import of
    ``pkg.mod`` when that is a module, else of ``pkg`` (its ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


# Cycles known when the check was added, each with the fix; strict, so the
# entry must go when the cycle does.
KNOWN_CYCLES: dict[str, str] = {}


@pytest.mark.parametrize(
    "sub",
    [
        pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN_CYCLES[s]))
        if s in KNOWN_CYCLES
        else s
        for s in sorted(ALLOWED)
    ],
)
def test_no_import_cycles_between_modules(sub):
    # Lazy imports (inside a function) count too: they hide a cycle, not remove it.
    files = {module_name(p, sub): p for p in sources(sub)}
    graph = {name: module_imports(path, name, set(files)) for name, path in files.items()}
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"dew.{sub} modules import each other in a cycle: {' -> '.join(cycle)}; move what "
        f"they share into a lower module"
    )
