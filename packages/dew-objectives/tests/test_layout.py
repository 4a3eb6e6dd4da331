"""dew-objectives' folders (issue 40): the paths from before them still import, each
with one DeprecationWarning naming where the module is now."""

import importlib
import sys
import warnings

import pytest

from dew.objectives import _moved


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    vars(sys.modules[parent]).pop(child, None)  # the attribute a first import set
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(name)  # as an import statement would (no importlib frame)
    module = sys.modules[name]
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(set(_moved.MOVED) - set(_moved.STABLE)))
def test_an_old_module_path_is_the_new_module_with_one_warning(old):
    new = importlib.import_module(f"dew.objectives.{_moved.MOVED[old]}")
    module, caught = _fresh_import(f"dew.objectives.{old}")
    assert module is new
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert new.__name__ in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the importing line


def test_the_seed_program_s_path_stays_without_a_warning():
    """``from dew.objectives.lm import LMObjective`` (the seed program, the key-concepts
    page) is the language family's module, silently."""
    new = importlib.import_module("dew.objectives.language.lm")
    module, caught = _fresh_import("dew.objectives.lm")
    assert module is new and caught == [], [str(w.message) for w in caught]


def test_the_rl_maths_old_path_forwards_its_names_with_one_warning():
    package = importlib.import_module("dew.objectives.rl")
    new = importlib.import_module("dew.objectives.cores.rl")
    vars(package).pop("group_advantages", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = package.group_advantages
        again = package.group_advantages
    assert value is again is new.group_advantages
    assert [str(w.message) for w in caught] == [
        "dew.objectives.rl.group_advantages moved to dew.objectives.cores.rl."
        "group_advantages; import it from there (the old path goes in a later release)"
    ]
    assert caught[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        package.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    ("folder", "name", "module"),
    [("diffusion", "DiffusionObjective", "images"), ("jepa", "JepaObjective", "jepa")],
)
def test_a_folder_named_like_its_old_module_keeps_its_names(folder, name, module):
    # the shortest path jsonargparse records in a saved recipe: no warning on reload
    package = importlib.import_module(f"dew.objectives.{folder}")
    vars(package).pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = getattr(package, name)
    assert value is getattr(importlib.import_module(f"{package.__name__}.{module}"), name)
    with pytest.raises(AttributeError, match="no attribute '_private'"):
        package._private  # noqa: B018
