"""Dew: a JAX training library.

A training run is four objects: a Flax model, an objective, a dataset and a
trainer. This umbrella package re-exports the names most runs type::

    from dew import Dataset, Trainer, models

The re-exports are lazy: ``import dew.nn`` never loads the trainer or Orbax.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

# name -> module that defines it
_EXPORTS = {
    "models": "dew.nn",
    "Dataset": "dew.data",
    "Partition": "dew.data",
    "ByteTokenizer": "dew.data",
    "Objective": "dew.objectives",
    "Trainer": "dew.train",
    "TrainState": "dew.train",
    "MeshSpec": "dew.train",
    "Checkpoints": "dew.train",
    "Sampling": "dew.sampling",
    "generate": "dew.sampling",
    "Pretrained": "dew.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(
            f"module 'dew' has no attribute {name!r}; dew exports: {', '.join(__all__)} "
            f"(subpackages: dew.nn, dew.data, dew.sampling, dew.objectives, dew.train)"
        )
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
