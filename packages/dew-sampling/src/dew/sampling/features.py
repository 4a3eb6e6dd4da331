"""Feature extraction with a trained encoder, and probes that score the features.

A :class:`FeatureExtractor` wraps an image or video encoder (a JEPA context or
target encoder, :meth:`dew.objectives.jepa.jepa.JepaObjective.export`) and its
parameters: ``extractor(images)`` returns mean-pooled features ``[batch,
features]`` or per-patch features ``[batch, patches, features]``. It saves to a
directory and loads back::

    features.json      {"format": "dew-features", "version": 1,
                        "model": {"name": <registry name>, "config": {...}},
                        "input_shape": [H, W, C] or [F, H, W, C], "pooling": "mean"}
    model.safetensors  tensors named by '/'-joined parameter paths

Probes (numpy, on the host): :func:`linear_probe_accuracy` fits a closed-form
ridge regression to one-hot labels; :func:`knn_accuracy` votes among the
``k`` nearest training features by cosine similarity.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dew.nn import models
from dew.nn.backbones.vit import scale_pixels
from dew.sampling.checkpoint_io.files import TensorReader, read_json_object, write_tensors

CONFIG = "features.json"
POOLINGS = ("mean", "none")


# Pixels as float32: ``uint8`` in [0, 255] maps to [-1, 1]; floats pass unchanged
# (what ``ViTClassifier`` does to its input).
scale_inputs = scale_pixels


def encode(encoder: nn.Module, params: Any, inputs: jax.Array, keep: jax.Array | None = None):
    """``[batch, patches, features]`` of ``inputs`` (``[batch, H, W, C]`` or
    ``[batch, F, H, W, C]``); with ``keep [batch, K]`` only those patch
    positions are encoded (the JEPA context): ``[batch, K, features]``."""
    variables = {"params": params}
    if keep is None:
        return encoder.apply(variables, inputs)
    return encoder.apply(variables, inputs, keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureExtractor:
    """An encoder and its parameters, as a task: inputs in, features out.

    encoder: the module (a registered one, e.g. ``dew.nn.backbones.ViT``, to save).
    params: its parameter tree.
    input_shape: one example's shape, ``(H, W, C)`` or ``(F, H, W, C)``.
    pooling: ``'mean'`` = the mean over patches, ``[batch, features]``;
      ``'none'`` = per-patch features ``[batch, patches, features]``.
    batch_size: examples per compiled call; longer inputs run in chunks.
    """

    encoder: Any
    params: Any
    input_shape: tuple[int, ...]
    pooling: str = "mean"
    batch_size: int = 256

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; use one of {POOLINGS}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 examples, got {self.batch_size}")
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        object.__setattr__(self, "params", nn.meta.unbox(self.params))

    def with_pooling(self, pooling: str) -> FeatureExtractor:
        return dataclasses.replace(self, pooling=pooling)

    @property
    def _apply(self):
        return _compiled_features(self.encoder, self.pooling == "mean")

    def __call__(self, inputs) -> np.ndarray:
        """Features of ``inputs [batch, *input_shape]`` (uint8 pixels or floats), on the host."""
        inputs = np.asarray(inputs)
        if inputs.shape[1:] != self.input_shape:
            raise ValueError(
                f"inputs have shape {inputs.shape}; this extractor reads rows of "
                f"{self.input_shape} ([batch, {', '.join(map(str, self.input_shape))}])"
            )
        chunks = []
        for start in range(0, len(inputs), self.batch_size):
            chunk = inputs[start : start + self.batch_size]
            rows = len(chunk)
            if rows < self.batch_size and start:  # one compiled shape: pad the last chunk
                pad = np.zeros((self.batch_size - rows, *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, pad])
            chunks.append(np.asarray(jax.device_get(self._apply(self.params, chunk)))[:rows])
        return np.concatenate(chunks) if chunks else np.zeros((0,), np.float32)

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write ``features.json`` and ``model.safetensors`` to directory ``path``."""
        name, config = models.config_of(self.encoder)
        path = pathlib.Path(path)
        flat = traverse_util.flatten_dict(self.params, sep="/")
        write_tensors(path, {k: np.asarray(jax.device_get(v)) for k, v in flat.items()})
        description = {
            "format": "dew-features",
            "version": 1,
            "model": {"name": name, "config": config},
            "input_shape": list(self.input_shape),
            "pooling": self.pooling,
        }
        (path / CONFIG).write_text(json.dumps(description, indent=2))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> FeatureExtractor:
        """Read a directory written by :meth:`save`; every tensor is checked
        against the rebuilt encoder's shapes."""
        path = pathlib.Path(path)
        if not (path / CONFIG).exists():
            raise FileNotFoundError(
                f"{path} has no {CONFIG}; FeatureExtractor.load takes a directory written "
                f"by FeatureExtractor.save"
            )
        description = read_json_object(path / CONFIG, what="the feature extractor description")
        if description.get("format") != "dew-features" or description.get("version") != 1:
            raise ValueError(
                f"{path / CONFIG}: expected format 'dew-features' version 1, got "
                f"{description.get('format')!r} version {description.get('version')!r}"
            )
        encoder = models.build(description["model"]["name"], **description["model"]["config"])
        input_shape = tuple(description["input_shape"])
        pixels = jax.ShapeDtypeStruct((1, *input_shape), jnp.float32)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # traced: nothing is drawn
        expected = nn.meta.unbox(jax.eval_shape(encoder.init, key, pixels)["params"])
        expected = traverse_util.flatten_dict(expected, sep="/")
        reader = TensorReader(path)
        missing, extra = sorted(set(expected) - reader.names), sorted(reader.names - set(expected))
        if missing or extra:
            raise ValueError(
                f"{path}: the weights do not match the encoder in {CONFIG}: missing tensors "
                f"{missing}, unexpected tensors {extra}"
            )
        flat = {}
        for name, spec in expected.items():
            value = reader[name]
            if tuple(value.shape) != tuple(spec.shape):
                raise ValueError(
                    f"{path}: tensor {name!r} has shape {value.shape}, but the encoder in "
                    f"{CONFIG} needs {tuple(spec.shape)}"
                )
            flat[name] = jnp.asarray(value)
        return cls(
            encoder=encoder,
            params=traverse_util.unflatten_dict(flat, sep="/"),
            input_shape=input_shape,
            pooling=description["pooling"],
        )


@functools.lru_cache(maxsize=32)
def _compiled_features(encoder, pool: bool):
    """One compiled feature function per (encoder, pooling), shared by every
    extractor of that encoder (a probe every N steps compiles once)."""

    @jax.jit
    def apply(params, x):
        features = encode(encoder, params, scale_inputs(x))  # [batch, patches, features]
        return features.mean(axis=1) if pool else features

    return apply


def _check_pairs(train_x, train_y, test_x, test_y):
    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    train_y, test_y = np.asarray(train_y).astype(np.int64), np.asarray(test_y).astype(np.int64)
    if train_x.ndim != 2 or test_x.ndim != 2 or train_x.shape[1] != test_x.shape[1]:
        raise ValueError(
            f"probes need pooled features [examples, features]; got train {train_x.shape}, "
            f"test {test_x.shape} (use pooling='mean')"
        )
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError(
            f"features and labels differ in length: train {len(train_x)} vs {len(train_y)}, "
            f"test {len(test_x)} vs {len(test_y)}"
        )
    return train_x, train_y, test_x, test_y


def linear_probe_accuracy(train_x, train_y, test_x, test_y, *, ridge: float = 1e-3) -> float:
    """Accuracy on ``test`` of a ridge regression to one-hot labels fitted on ``train``.

    Features are standardised with the training mean and std; the weights are
    ``W = (X^T X + ridge * n * I)^-1 X^T Y`` with a bias column (not penalised)."""
    train_x, train_y, test_x, test_y = _check_pairs(train_x, train_y, test_x, test_y)
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    x = np.concatenate([(train_x - mean) / std, np.ones((len(train_x), 1))], axis=1)
    t = np.concatenate([(test_x - mean) / std, np.ones((len(test_x), 1))], axis=1)
    classes = int(max(train_y.max(), test_y.max())) + 1
    y = np.eye(classes)[train_y]
    penalty = ridge * len(x) * np.eye(x.shape[1])
    penalty[-1, -1] = 0.0
    weights = np.linalg.solve(x.T @ x + penalty, x.T @ y)
    return float(np.mean(np.argmax(t @ weights, axis=1) == test_y))


def knn_accuracy(train_x, train_y, test_x, test_y, *, k: int = 20) -> float:
    """Accuracy of a majority vote among the ``k`` most cosine-similar training features."""
    train_x, train_y, test_x, test_y = _check_pairs(train_x, train_y, test_x, test_y)
    a = train_x / (np.linalg.norm(train_x, axis=1, keepdims=True) + 1e-12)
    b = test_x / (np.linalg.norm(test_x, axis=1, keepdims=True) + 1e-12)
    k = min(k, len(a))
    nearest = np.argsort(-(b @ a.T), axis=1, kind="stable")[:, :k]  # [test, k]
    classes = int(max(train_y.max(), test_y.max())) + 1
    votes = np.zeros((len(b), classes))
    np.add.at(votes, (np.arange(len(b))[:, None], train_y[nearest]), 1.0)
    return float(np.mean(np.argmax(votes, axis=1) == test_y))
