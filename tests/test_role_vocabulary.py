"""Every family names its roles from one vocabulary (``dew.objectives.ROLE_NAMES``)
and declares its relations: the trained generator is ``policy`` everywhere, a
reference is ``Role(initial_from='policy')`` when no reference weights are given,
JEPA's target is ``Role(averages='encoder')``. Objectives are only built, nothing
is compiled."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from dew.objectives import ROLE_NAMES, check_roles


def _families():
    path = pathlib.Path(__file__).with_name("test_family_contract.py")
    spec = importlib.util.spec_from_file_location("family_contract", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("family_contract", module)
    spec.loader.exec_module(module)
    return module.FAMILIES


FAMILIES = _families()

# (trained, frozen or averaged with their relation) of each family's contract case
EXPECTED = {
    "lm": ({"policy"}, {}),
    "diffusion": ({"policy"}, {}),
    "jepa": ({"encoder", "predictor"}, {"target": ("averages", "encoder")}),
    "dpo": ({"policy"}, {"reference": ("initial_from", "policy")}),
    "grpo": ({"policy"}, {"reference": ("initial_from", "policy")}),
    "ppo": ({"policy", "value"}, {"reference": ("initial_from", "policy")}),
    "mdlm": ({"policy"}, {}),
    "bd3": ({"policy"}, {}),
    "distill": ({"policy"}, {"teacher": None}),
    "flow_grpo": ({"policy"}, {"reference": ("initial_from", "policy")}),
    "kto": ({"policy"}, {"reference": ("initial_from", "policy")}),
    "online_dpo": ({"policy"}, {"reference": ("initial_from", "policy"), "reward": None}),
    "reward_model": ({"reward"}, {}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_names_its_roles_from_the_vocabulary(family):
    objective = FAMILIES[family]().objective
    roles = check_roles(objective)
    assert all(r.name in ROLE_NAMES for r in roles), [r.name for r in roles]
    trained, others = EXPECTED[family]
    assert {r.name for r in roles if r.trained} == trained
    got = {}
    for r in roles:
        if not r.trained:
            relation = next(
                ((k, getattr(r, k)) for k in ("initial_from", "averages") if getattr(r, k)), None
            )
            got[r.name] = relation
    # a family whose case has no reference (beta = 0) declares none
    assert got == {k: v for k, v in others.items() if k in got} and set(got) <= set(others)
    assert not hasattr(type(objective), "uses_averaged")


def test_classifier_distillation_names_its_roles_from_the_vocabulary():
    """Not in the family contract (no LM batch): its roles checked on their own."""
    import flax.linen as nn

    from dew.objectives.language.classifier_distillation import ClassifierDistillationObjective

    objective = ClassifierDistillationObjective(
        student=nn.Dense(3), teacher=nn.Dense(3), teacher_params={}
    )
    roles = check_roles(objective)
    assert [(r.name, r.trained) for r in roles] == [("policy", True), ("teacher", False)]
