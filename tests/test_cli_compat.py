"""dew.cli.compat: the private names of other libraries that ``dew`` uses, pinned
to the versions they were read from, and ``dew.cli`` free of import cycles and of
``_src`` imports outside that module."""

import ast
import importlib.metadata
import pathlib

from dew.cli import compat

CLI = pathlib.Path(compat.__file__).parent


def test_written_for_the_installed_versions():
    """A new version of a library fails here: re-read the private names it wraps
    (``jax._src.clusters``), then add the version to ``WRITTEN_FOR``."""
    for library, versions in compat.WRITTEN_FOR.items():
        installed = importlib.metadata.version(library)
        assert installed in versions, (
            f"dew.cli.compat was written for {library} {versions}; {installed} is installed"
        )


def test_cluster_environments_are_jax_detection_order():
    from jax._src import clusters

    found = compat.cluster_environments()
    assert found == list(clusters.ClusterEnv._cluster_types) and len(found) >= 5
    names = [env.__name__ for env in found]
    assert {"SlurmCluster", "GkeTpuCluster", "K8sCluster"} <= set(names), names
    for env in found:
        assert callable(env.is_env_present) and callable(env.get_process_count)
        assert isinstance(env.opt_in_only_method, bool)


def imports(path: pathlib.Path) -> set[str]:
    """The modules ``path`` imports, at its top or inside a function."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(CLI.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_and_no_private_imports_outside_compat():
    files = sorted(CLI.rglob("*.py"))
    graph = {module_name(p): imports(p) for p in files}
    assert "dew.cli.commands.train" in graph and "dew.cli" in graph

    def reaches(start, goal, seen=()):
        for target in graph.get(start, ()):
            if target == goal:
                return True
            if target in graph and target not in seen:
                if reaches(target, goal, (*seen, target)):
                    return True
        return False

    cycles = [m for m in graph if reaches(m, m)]
    assert not cycles, f"import cycles through {cycles}"
    for path in files:
        text = path.read_text()
        if path.name != "compat.py":
            assert "._src" not in text and "_src import" not in text, path
