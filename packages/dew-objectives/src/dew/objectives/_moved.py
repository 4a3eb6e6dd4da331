"""The module paths dew-objectives had before its family folders (issue 40), kept
importable for recipes and code written against them: ``import dew.objectives.grpo``
gives ``dew.objectives.rl.grpo`` with one ``DeprecationWarning`` naming the new path.

Three old modules share their name with a folder (``rl``, ``diffusion``, ``jepa``):
the folder's ``__getattr__`` (:func:`forward`) hands out the old module's names.
``diffusion`` and ``jepa`` keep them as the folder's own public names (its family's
objective: ``dew.objectives.diffusion.DiffusionObjective``, the shortest path a saved
recipe records), ``rl``'s (the RL maths, now ``cores.rl``) warn.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import pathlib
import sys
import warnings
from typing import Any

PACKAGE = "dew.objectives"

# old module (under dew.objectives) -> its place now (cores.image_rewards: merged into
# cores.rewards after the folders)
MOVED = {
    "base": "contract.objective",
    "batch": "contract.batch",
    "weighted": "contract.weighted",
    "policy": "cores.policy",
    "logprobs": "cores.logprobs",
    "rollouts": "cores.rollouts",
    "rewards": "cores.rewards",
    "image_rewards": "cores.rewards",
    "cores.image_rewards": "cores.rewards",
    "text_conditioning": "cores.conditioning",
    "lm": "language.lm",
    "distillation": "language.distillation",
    "classifier_distillation": "language.classifier_distillation",
    "teacher_topk": "language.teacher_topk",
    "dpo": "preference.dpo",
    "grpo": "rl.grpo",
    "ppo": "rl.ppo",
    "flow_grpo": "rl.flow_grpo",
    "masked_diffusion": "diffusion.masked",
    "block_diffusion": "diffusion.block",
    "jepa_masks": "jepa.masks",
}
# old module that is now a folder's name -> where its names went
FOLDED = {"rl": "cores.rl", "diffusion": "diffusion.images", "jepa": "jepa.jepa"}
DEPRECATED = ("rl",)  # of FOLDED: the folder's own names are not these
# of MOVED: short public paths that stay, without a warning (`from dew.objectives.lm
# import LMObjective` is the seed program's and the key-concepts page's import)
STABLE = ("lm",)


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in a later release)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``dew.objectives.<old>`` and loads it as the module at its new path."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname.startswith(f"{PACKAGE}.") and fullname[len(PACKAGE) + 1 :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module) -> None:
        old = module.__name__
        short = old[len(PACKAGE) + 1 :]
        new = f"{PACKAGE}.{MOVED[short]}"
        if short not in STABLE:
            _warn(old, new, stacklevel=2)  # importlib's own frames are skipped
        sys.modules[old] = importlib.import_module(new)


def install() -> None:
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def forward(folder: str, name: str) -> Any:
    """A folder's ``__getattr__``: ``name`` from the old module of the folder's name
    (``dew.objectives.rl.group_advantages`` -> ``dew.objectives.cores.rl``, with a
    warning; ``dew.objectives.jepa.JepaObjective`` -> ``dew.objectives.jepa.jepa``)."""
    old = folder.rpartition(".")[2]
    new = f"{PACKAGE}.{FOLDED[old]}"
    here = pathlib.Path(sys.modules[folder].__file__).parent
    if name.startswith("_") or (here / f"{name}.py").exists():  # a submodule: import it
        raise AttributeError(f"module {folder!r} has no attribute {name!r}")
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {folder!r} has no attribute {name!r}")
    if old in DEPRECATED:
        _warn(f"{folder}.{name}", f"{new}.{name}", stacklevel=3)
    value = getattr(module, name)
    setattr(sys.modules[folder], name, value)  # found directly from now on
    return value
