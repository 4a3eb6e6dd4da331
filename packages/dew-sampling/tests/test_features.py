"""FeatureExtractor: pooled == mean of per-patch == the encoder itself, chunked
== one call, save/load round trip; probes against hand-worked and numpy answers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import ViT
from dew.sampling.features import FeatureExtractor, knn_accuracy, linear_probe_accuracy

ENCODER = ViT(
    emb_features=16,
    num_layers=1,
    num_heads=2,
    mlp_features=32,
    image_size=8,
    patch_size=4,
    num_channels=1,
)


@pytest.fixture(scope="module")
def extractor():
    params = nn.unbox(ENCODER.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1))))["params"]
    return FeatureExtractor(encoder=ENCODER, params=params, input_shape=(8, 8, 1), batch_size=4)


def test_features_are_the_encoders_mean_over_patches(extractor):
    pixels = np.random.default_rng(0).integers(0, 256, (7, 8, 8, 1)).astype(np.uint8)
    pooled = extractor(pixels)  # 7 rows in chunks of 4, the last one padded
    patches = extractor.with_pooling("none")(pixels)
    direct = ENCODER.apply(
        {"params": extractor.params}, jnp.asarray(pixels, jnp.float32) / 127.5 - 1.0
    )
    assert pooled.shape == (7, 16) and patches.shape == (7, 4, 16)
    np.testing.assert_allclose(patches, np.asarray(direct), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled, np.asarray(direct).mean(axis=1), rtol=1e-5, atol=1e-6)


def test_save_and_load_give_the_same_features(extractor, tmp_path):
    pixels = np.random.default_rng(1).normal(size=(3, 8, 8, 1)).astype(np.float32)
    extractor.save(tmp_path / "features")
    loaded = FeatureExtractor.load(tmp_path / "features")
    assert loaded.encoder == ENCODER and loaded.input_shape == (8, 8, 1)
    np.testing.assert_array_equal(loaded(pixels), extractor(pixels))
    with pytest.raises(FileNotFoundError, match="features.json"):
        FeatureExtractor.load(tmp_path)


def test_wrong_inputs_are_refused(extractor):
    with pytest.raises(ValueError, match=r"rows of \(8, 8, 1\)"):
        extractor(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="pooling"):
        extractor.with_pooling("max")


def test_linear_probe_is_ridge_regression_to_one_hot_labels():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 200)
    x = 4.0 * np.eye(4, 5)[y] + rng.normal(size=(200, 5))  # four separated blobs
    assert linear_probe_accuracy(x[:150], y[:150], x[150:], y[150:]) > 0.9
    # numpy: the same closed form, written out
    mean, std = x[:150].mean(0), x[:150].std(0) + 1e-6
    a = np.c_[(x[:150] - mean) / std, np.ones(150)]
    b = np.c_[(x[150:] - mean) / std, np.ones(50)]
    penalty = 0.1 * 150 * np.eye(6)
    penalty[-1, -1] = 0
    w = np.linalg.solve(a.T @ a + penalty, a.T @ np.eye(4)[y[:150]])
    want = np.mean(np.argmax(b @ w, 1) == y[150:])
    assert linear_probe_accuracy(x[:150], y[:150], x[150:], y[150:], ridge=0.1) == want
    noise, coin = rng.normal(size=(400, 5)), rng.integers(0, 2, 400)  # nothing to learn
    assert linear_probe_accuracy(noise[:300], coin[:300], noise[300:], coin[300:]) < 0.65


def test_knn_votes_among_the_most_cosine_similar():
    train = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]])
    labels = np.array([0, 0, 1, 1, 2])
    test = np.array([[2.0, 0.1], [0.2, 3.0], [-1.0, 0.1]])
    assert knn_accuracy(train, labels, test, np.array([0, 1, 2]), k=1) == 1.0
    # k=3: the third point's neighbours are 2 (itself), then the two class-1 points
    assert knn_accuracy(train, labels, test, np.array([0, 1, 2]), k=3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="pooled features"):
        knn_accuracy(np.zeros((2, 3, 4)), labels[:2], test, labels[:3])
