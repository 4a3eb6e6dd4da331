"""The objective names recipes use, registered next to each family
(dew.objectives.contract.registry)."""

import dataclasses

import pytest

from dew.objectives import Objective
from dew.objectives.contract import registry
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.language.lm import LMObjective
from dew.objectives.rl.grpo import GRPOObjective

FAMILIES = {
    "lm": "dew.objectives.language.lm:LMObjective",
    "distillation": "dew.objectives.language.distillation:DistillationObjective",
    "classifier_distillation": (
        "dew.objectives.language.classifier_distillation:ClassifierDistillationObjective"
    ),
    "dpo": "dew.objectives.preference.dpo:DPOObjective",
    "grpo": "dew.objectives.rl.grpo:GRPOObjective",
    "ppo": "dew.objectives.rl.ppo:PPOObjective",
    "flow_grpo": "dew.objectives.rl.flow_grpo:FlowGRPOObjective",
    "diffusion": "dew.objectives.diffusion.images:DiffusionObjective",
    "masked_diffusion": "dew.objectives.diffusion.masked:MaskedDiffusionObjective",
    "block_diffusion": "dew.objectives.diffusion.block:BlockDiffusionObjective",
    "jepa": "dew.objectives.jepa.jepa:JepaObjective",
}


def test_every_family_is_registered_under_the_name_recipes_use():
    # at least these (a family added later registers itself beside them)
    assert {name: registry.OBJECTIVES[name] for name in FAMILIES} == FAMILIES
    assert registry.get("lm") is LMObjective
    assert registry.get("grpo") is GRPOObjective
    assert registry.get("block_diffusion") is BlockDiffusionObjective
    assert all(issubclass(registry.get(name), Objective) for name in registry.names())
    assert sorted(registry.OBJECTIVES) == registry.names()


def test_an_unknown_name_lists_the_registered_ones_and_the_nearest():
    with pytest.raises(KeyError) as error:
        registry.get("grop")
    message = error.value.args[0]
    assert "unknown objective 'grop'; did you mean 'grpo'?" in message
    assert all(name in message for name in FAMILIES)
    assert registry.OBJECTIVES.get("grop") is None


def test_a_taken_name_is_refused_naming_its_class():
    @dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
    class Mine(Objective):
        model: object = None

    with pytest.raises(ValueError, match="'lm' is already registered to dew.objectives.language"):
        registry.register("lm")(Mine)
    assert registry.get("lm") is LMObjective
    with pytest.raises(ValueError, match="an identifier"):
        registry.register("my objective")
