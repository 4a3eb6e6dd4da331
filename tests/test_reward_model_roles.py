"""GRPO and PPO judged by a trained reward model, through ``Trainer``: the role
``reward`` stays frozen. The cases live beside the families' own tests in
packages/dew-objectives/tests, which run without dew-train; they take the
``dew.train`` module from here."""

import importlib.util
import pathlib

import pytest

import dew.train

TESTS = pathlib.Path(__file__).parents[1] / "packages" / "dew-objectives" / "tests"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"objectives_{name}", TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["test_grpo", "test_ppo"])
def test_fit_keeps_the_reward_model_frozen(family):
    _module(family).fit_keeps_the_reward_model_frozen(dew.train)
