"""dew-objectives in three layers (issue 40), stated over the import statements of
its source: the contract imports nothing else of the package; a core imports the
contract and other cores only; a family imports the contract and the cores, and of
the families only its own folder's (BD3-LM on MDLM). dew-train imports the
contract and the public names (``dew.objectives``), no core or family."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).parents[1] / "src" / "dew" / "objectives"
TRAIN = pathlib.Path(__file__).parents[2] / "dew-train" / "src"
FAMILIES = ("language", "preference", "rl", "diffusion", "jepa")


def imports(path: pathlib.Path) -> set[str]:
    """The dew.objectives modules ``path`` imports (anywhere in it, lazily too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names}
            found.add(node.module)
    return {name for name in found if name.startswith("dew.objectives.")}


def layer(module: str) -> str:
    """``contract``, ``cores``, a family folder, or ``top`` (the package's own)."""
    parts = module.split(".")
    if len(parts) < 3:
        return "top"
    return parts[2] if len(parts) > 3 or parts[2] in (*FAMILIES, "contract", "cores") else "top"


def modules():
    for path in sorted(SRC.rglob("*.py")):
        name = ".".join(("dew", "objectives", *path.relative_to(SRC).with_suffix("").parts))
        yield name.removesuffix(".__init__"), path


ALLOWED = {
    "contract": {"contract"},
    "cores": {"contract", "cores"},
    **{family: {"contract", "cores", family} for family in FAMILIES},
}


@pytest.mark.parametrize(("module", "path"), list(modules()), ids=lambda v: str(v))
def test_a_module_imports_only_the_layers_below_it(module, path):
    here = layer(module)
    if here not in ALLOWED:
        return  # the package's own __init__ and _moved: the public names, the old paths
    wrong = sorted(
        name
        for name in imports(path)
        if layer(name) not in ALLOWED[here] and name.split(".")[2] not in {"_moved"}
    )
    assert not wrong, f"{module} ({here}) imports {wrong}; it may import {sorted(ALLOWED[here])}"


def test_the_folders_are_the_layout():
    assert sorted(p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__") == (
        sorted(("contract", "cores", *FAMILIES))
    )


def test_dew_train_imports_the_contract_and_the_public_names_only():
    wrong = {
        str(path.relative_to(TRAIN)): sorted(
            n for n in imports(path) if layer(n) not in ("contract", "top")
        )
        for path in TRAIN.rglob("*.py")
    }
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"dew-train reaches past the contract: {wrong}"


def test_no_module_imports_another_modules_private_names():
    private = {
        f"{module}: {node.module}.{alias.name}"
        for module, path in modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dew.objectives")
        for alias in node.names
        if alias.name.startswith("_") and alias.name != "_moved"
    }
    assert not private, f"private names imported across modules: {sorted(private)}"
