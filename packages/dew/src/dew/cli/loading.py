"""A recipe file read for a command: overrides applied, relative paths anchored at
the file's folder, JAX's compilation cache set, the run's objects built."""

from __future__ import annotations

import os

from dew.cli.recipe import apply_overrides, load_recipe, parse_recipe, shorthands

__all__ = [
    "add_recipe_arguments",
    "anchored",
    "compilation_cache",
    "prepared",
    "read_recipe",
    "with_run_dir",
]


def add_recipe_arguments(parser) -> None:
    """``RECIPE [key=value ...]``: the arguments of every command that reads a recipe."""
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", metavar="key=value")


def compilation_cache(setting: str | bool) -> str | None:
    """JAX's persistent compilation cache: on by default for the command.
    ``off`` (recipe ``compilation_cache: off`` or ``DEW_COMPILATION_CACHE=off``)
    turns it off; a path moves it (and turns it on); the environment variable
    wins over the recipe. A cache the environment already names
    (``JAX_COMPILATION_CACHE_DIR``) is kept. Returns the directory in use."""
    import jax

    env = os.environ.get("DEW_COMPILATION_CACHE")
    setting = env or {False: "off", True: "default"}.get(setting, setting)
    if setting == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if setting == "default":
        current = jax.config.jax_compilation_cache_dir
        if current:
            return current
        setting = os.path.expanduser("~/.cache/dew/jax")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", setting)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return setting


PATH_KEYS = {
    "data": ("paths", "path", "source", "val_paths", "val_source", "path_or_name"),
    "tokenizer": ("files", "path"),
    "model": ("pretrained",),
}


def anchored(raw: dict, base: str) -> dict:
    """Relative paths of a recipe file that exist from its folder, made absolute
    (so a recipe runs from any directory and the saved recipe from any other),
    those of a mixture's ``sources`` included."""

    def fix(value):
        if isinstance(value, list):
            return [fix(v) for v in value]
        if isinstance(value, str) and not os.path.isabs(value):
            candidate = os.path.join(base, value)
            if os.path.exists(candidate):
                return os.path.abspath(candidate)
        return value

    def fix_keys(node, keys):
        for key in keys:
            if isinstance(node, dict) and key in node:
                node[key] = fix(node[key])

    raw = shorthands(raw)
    for section, keys in PATH_KEYS.items():
        node = raw.get(section)
        if isinstance(node, dict):
            node = node.get("args", node) if section == "data" else node
            fix_keys(node, keys)
            sources = node.get("sources") if section == "data" and isinstance(node, dict) else None
            for source in sources if isinstance(sources, list) else ():
                if isinstance(source, dict):  # a mixture's sources (MixtureOf)
                    fix_keys(source.get("args"), keys)
    return raw


def read_recipe(path: str, overrides) -> dict:
    raw = apply_overrides(load_recipe(path), overrides)
    return anchored(raw, os.path.dirname(os.path.abspath(path)))


def prepared(raw: dict, *, with_data: bool = True):
    """``(recipe, built)`` of a raw recipe dict."""
    from dew.cli.build import build

    recipe = parse_recipe(raw)
    compilation_cache(recipe.compilation_cache)
    return recipe, build(recipe, recipe.run_dir, with_data=with_data)


def with_run_dir(raw: dict, recipe_path: str, *, agree=None) -> dict:
    """``raw`` with its ``run_dir``: the recipe's own, else a new folder named after
    the recipe file: ``runs/NAME``, or ``runs/NAME-2``, ``runs/NAME-3``, ... when
    that one exists (as Lightning numbers its versions); a re-run never continues
    or changes an earlier run unless the recipe names its folder.

    agree: ``number -> number`` that makes every process of a run use the first
    process's (``dew train`` across processes: one folder, whatever each host sees)."""
    if raw.get("run_dir"):
        return raw
    name = os.path.splitext(os.path.basename(recipe_path))[0]
    number = 1
    while os.path.exists(_numbered(name, number)):
        number += 1
    if agree is not None:
        number = agree(number)
    return {**raw, "run_dir": _numbered(name, number)}


def _numbered(name: str, number: int) -> str:
    return os.path.join("runs", name if number == 1 else f"{name}-{number}")
