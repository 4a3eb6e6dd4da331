"""The shape is visible (issue 40, item 8): no source file of dew-objectives or
dew-train over 600 lines, no class in them with more than 15 methods. A method is
every ``def`` in the class body: methods, properties, cached properties, class and
static methods (a nested function inside a method is not one)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1] / "packages"
PACKAGES = {
    "dew-objectives": ROOT / "dew-objectives" / "src" / "dew" / "objectives",
    "dew-train": ROOT / "dew-train" / "src" / "dew" / "train",
}
MAX_LINES = 600
MAX_METHODS = 15


def line_count(text: str) -> int:
    """Lines as ``wc -l`` counts them."""
    return text.count("\n")


def method_counts(text: str) -> dict[str, int]:
    """``{class name: defs in its body}`` of every class in ``text``, nested ones too."""
    return {
        node.name: sum(
            isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body
        )
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
    }


def sources():
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            yield package, path


def test_the_counts_are_what_a_reader_counts():
    text = (
        "class A:\n"
        "    x = 1\n"
        "    def f(self):\n"
        "        def inner():\n"
        "            pass\n"
        "    @property\n"
        "    def g(self): ...\n"
        "    @classmethod\n"
        "    def h(cls): ...\n"
        "    async def i(self): ...\n"
        "    class B:\n"
        "        def j(self): ...\n"
    )
    assert line_count(text) == 12
    assert method_counts(text) == {"A": 4, "B": 1}


def test_both_packages_have_sources():
    for package, root in PACKAGES.items():
        assert sum(1 for _ in root.rglob("*.py")) > 5, f"{package}: no sources under {root}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_file_is_over_600_lines(package):
    long = {
        str(path.relative_to(ROOT)): n
        for p, path in sources()
        if p == package and (n := line_count(path.read_text())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_class_has_more_than_15_methods(package):
    big = {
        f"{path.relative_to(ROOT)}::{name}": n
        for p, path in sources()
        if p == package
        for name, n in method_counts(path.read_text()).items()
        if n > MAX_METHODS
    }
    assert not big, (
        f"classes with more than {MAX_METHODS} methods (give a cohesive part its own "
        f"component or module): {big}"
    )
