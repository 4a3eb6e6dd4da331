"""dew.train._compat: the private names of other libraries that dew-train uses,
pinned to the versions they were read from; no ``_src`` import anywhere else in
Dew's packages (the command line's are in ``dew.cli.compat``)."""

import importlib.metadata
import pathlib

from dew.train import _compat

PACKAGES = pathlib.Path(_compat.__file__).parents[4]  # .../packages
COMPAT = {"dew-train/src/dew/train/_compat.py", "dew/src/dew/cli/compat.py"}


def test_written_for_the_installed_versions():
    """A new version of a library fails here: re-read the private names it wraps,
    then add the version to ``WRITTEN_FOR``."""
    for library, versions in _compat.WRITTEN_FOR.items():
        installed = importlib.metadata.version(library)
        assert installed in versions, (
            f"dew.train._compat was written for {library} {versions}; {installed} is installed"
        )


def test_orbax_async_handler_is_orbax_s():
    import orbax.checkpoint as ocp

    handler, commit = _compat.orbax_async_handler()
    assert issubclass(handler, ocp.CheckpointHandler) and hasattr(handler, "async_save")
    assert callable(commit)


def test_no_private_imports_outside_the_compat_modules():
    sources = sorted(PACKAGES.glob("*/src/**/*.py"))
    assert len(sources) > 50, PACKAGES
    found = []
    for path in sources:
        if str(path.relative_to(PACKAGES)) in COMPAT:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if ("import" in code) and ("._src" in code or "_src import" in code):
                found.append(f"{path.relative_to(PACKAGES)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
