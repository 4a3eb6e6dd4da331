"""The umbrella `dew`: lazy re-exports over the namespace portions."""

import subprocess
import sys

import pytest


def test_names_users_type():
    from dew import Dataset, Trainer, models
    from dew.data import Dataset as DataDataset
    from dew.nn import models as nn_models
    from dew.train import Trainer as TrainTrainer

    assert Dataset is DataDataset and Trainer is TrainTrainer and models is nn_models


def test_unknown_name_lists_exports():
    import dew

    with pytest.raises(AttributeError) as info:
        dew.Nonexistent  # noqa: B018
    message = str(info.value)
    assert "'Nonexistent'" in message
    for name in ("Dataset", "Trainer", "models", "MeshSpec"):
        assert name in message
    with pytest.raises(ImportError):
        exec("from dew import Nonexistent")


def test_import_dew_nn_loads_no_training_code():
    code = (
        "import sys, dew.nn; "
        "bad = [m for m in sys.modules if m.startswith(('dew.train', 'orbax', 'dew.objectives', "
        "'optax'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_dew_alone_is_lazy():
    code = "import sys, dew; assert 'dew.train' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_export_resolves_to_its_subpackage_object():
    import importlib

    import dew

    for name in dew.__all__:
        module = importlib.import_module(dew._EXPORTS[name])
        assert getattr(dew, name) is getattr(module, name), name
