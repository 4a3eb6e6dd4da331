"""DiffusionObjective with a text encoder trained with the denoiser (a second trained role):
its loss is the frozen route's loss on the same encoder weights and a hand composition of
encoder and denoiser, the gradient reaches the encoder, and the exported pipeline encodes
prompts with the trained weights through save -> Pretrained.load."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.data import ByteTokenizer
from dew.nn import models
from dew.nn.testing import TINY_LM
from dew.objectives.contract.objective import Step
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import DDPMSchedule, Pretrained, TextEncoder, TextToImage
from dew.sampling.diffusion.pipelines import to_pixels
from dew.sampling.diffusion.text_encoders import encode_tokens

DIT = dict(
    sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=1, num_heads=2,
    mlp_features=32, use_scan=False, context_features=16,
)  # fmt: skip
LENGTH = 6
CAPTIONS = ["a red square", "two dots", "", "a long caption cut at six"]
SCHEDULE = DDPMSchedule(kind="cosine", num_timesteps=100)


def perturbed(params, seed, scale=0.2):
    """Random values at the shapes of ``params`` (numpy, so nothing compiles): off DiT's
    zero initialisation (adaLN-Zero outputs 0, so no gradient reaches the context)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.normal(0.0, scale, x.shape), x.dtype), nn.meta.unbox(params)
    )


@pytest.fixture(scope="module")
def setup():
    lm = models.build("causal_transformer", **{**TINY_LM, "vocab_size": 264, "num_layers": 1})
    spec = TextEncoder(module=lm, params=None, tokenizer=ByteTokenizer(), max_length=LENGTH)
    dit = models.build("dit", **DIT)
    trained = DiffusionObjective(
        model=dit, schedule=SCHEDULE, target="v", text_encoder=spec, train_text_encoder=True
    )
    params = perturbed(jax.eval_shape(trained.init, jax.random.key(0))["params"], 0)
    rng = np.random.default_rng(0)
    batch = {
        "image": rng.integers(0, 256, (4, 8, 8, 1), dtype=np.uint8),
        "text": spec.tokenize(CAPTIONS),
    }
    return trained, {"params": params}, batch


STEP = Step(index=jnp.int32(3), key=jax.random.key(7))  # cond_dropout 0.1 draws inside
TIME = np.array([0, 30, 60, 99], np.int32)
NOISE = np.random.default_rng(1).standard_normal((4, 8, 8, 1)).astype(np.float32)


@pytest.fixture(scope="module")
def computed(setup):
    """Everything the loss tests read, in one compiled program: the trained route's loss
    and gradient, the frozen route's loss on a precomputed context, and the parts of the
    hand computation."""
    trained, variables, batch = setup
    frozen = DiffusionObjective(
        model=trained.model,
        schedule=SCHEDULE,
        target="v",
        text_encoder=trained.text_encoder_of(variables),
    )

    @jax.jit
    def run(params, batch):
        def loss(p):
            return trained.loss({"params": p}, batch, STEP)[0].value

        value, grads = jax.value_and_grad(loss)(params)
        context = encode_tokens(trained.text_encoder.module, params["text_encoder"], batch["text"])
        frozen_batch = {"image": batch["image"], "context": context}
        frozen_value = frozen.loss({"params": {"policy": params["policy"]}}, frozen_batch, STEP)[
            0
        ].value
        per_row, _ = trained.per_example_loss(params, batch, time=TIME, noise=NOISE, drop_key=None)
        return dict(value=value, grads=grads, context=context, frozen=frozen_value, per_row=per_row)

    return frozen, jax.device_get(run(variables["params"], batch))


def test_the_loss_is_the_frozen_routes_on_the_same_encoder_weights(setup, computed):
    trained, variables, batch = setup
    frozen, out = computed
    trained.check_batch(batch)
    frozen.check_batch({"image": batch["image"], "context": out["context"]})
    # the frozen encoder's own call (its compiled program, host tokenization) == E_phi(ids)
    np.testing.assert_allclose(
        np.asarray(frozen.text_encoder(CAPTIONS)), out["context"], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(out["value"], out["frozen"], rtol=1e-6)

    # by hand: v-target regression of the DiT on E_phi(ids), numpy for the mixing
    abar = np.cumprod(1.0 - SCHEDULE.betas)[TIME][:, None, None, None]
    alpha, sigma = np.sqrt(abar), np.sqrt(1.0 - abar)
    x0 = batch["image"].astype(np.float64) / 127.5 - 1.0
    x_t = alpha * x0 + sigma * NOISE
    denoise = jax.jit(trained.model.apply)
    model_out = denoise(
        {"params": variables["params"]["policy"]},
        jnp.asarray(x_t, jnp.float32),
        jnp.asarray(TIME),
        context=jnp.asarray(out["context"]),
    )
    v = alpha * NOISE - sigma * x0
    hand = np.mean((np.asarray(model_out, np.float64) - v).reshape(4, -1) ** 2, axis=1)
    np.testing.assert_allclose(out["per_row"], hand, rtol=2e-5, atol=1e-6)


def test_gradients_reach_the_trained_encoder_only_as_a_role(setup, computed):
    trained, variables, batch = setup
    _, out = computed
    assert [(r.name, r.trained) for r in trained.roles()] == [
        ("policy", True),
        ("text_encoder", True),
    ]
    embed = out["grads"]["text_encoder"]["embed"]["embedding"]  # [vocab, embed]
    drop_keys = [jax.random.split(k, 3)[2] for k in STEP.row_keys(4)]  # the loss's per-row draw
    drop = np.asarray([jax.random.bernoulli(k, 0.1) for k in drop_keys])
    assert drop.sum() <= 1  # at most one of the four rows trains on the null context
    seen = np.unique(batch["text"][~drop])
    assert np.abs(embed[seen]).sum(axis=1).min() > 1e-6  # every kept token gets a gradient
    unseen = np.setdiff1d(np.arange(264), np.unique(batch["text"]))
    np.testing.assert_array_equal(embed[unseen], 0.0)  # tokens not in the batch get none

    frozen = DiffusionObjective(
        model=trained.model, schedule=SCHEDULE, text_encoder=trained.text_encoder_of(variables)
    )
    assert [(r.name, r.trained) for r in frozen.roles()] == [("policy", True)]
    frozen_params = jax.eval_shape(frozen.init, jax.random.key(0))["params"]
    assert "text_encoder" not in frozen_params  # the frozen encoder is not optimized
    assert jax.tree.structure(nn.meta.unbox(frozen_params["policy"])) == jax.tree.structure(
        variables["params"]["policy"]
    )


def test_export_save_load_samples_with_the_trained_encoder(setup, tmp_path):
    trained, variables, _ = setup
    pipe = trained.export(variables)
    assert isinstance(pipe, TextToImage)
    np.testing.assert_array_equal(
        pipe.text_encoder.params["embed"]["embedding"],
        variables["params"]["text_encoder"]["embed"]["embedding"],
    )
    images = pipe(CAPTIONS[:2], num_steps=3, seed=4)
    samples = trained.sample(variables, jax.random.key(4), prompts=CAPTIONS[:2], num_steps=3)
    np.testing.assert_array_equal(images, to_pixels(samples))
    pipe.save(tmp_path / "pipe")
    loaded = Pretrained.load(tmp_path / "pipe").pipeline()
    np.testing.assert_array_equal(loaded(CAPTIONS[:2], num_steps=3, seed=4), images)
    # a different encoder (the untrained init) gives different samples: the weights matter
    other = {"params": {**variables["params"], "text_encoder": perturbed(
        variables["params"]["text_encoder"], 9, 0.5)}}  # fmt: skip
    assert not np.array_equal(trained.export(other)(CAPTIONS[:2], num_steps=3, seed=4), images)


def test_bad_input_is_refused_before_compiling(setup):
    trained, _, batch = setup
    with pytest.raises(KeyError, match=r"reads batch\['text'\] \[rows, 6\] integer"):
        trained.check_batch({"image": batch["image"]})
    with pytest.raises(ValueError, match=r"\(4, 3\), but DiffusionObjective reads \[rows, 6\]"):
        trained.check_batch({"image": batch["image"], "text": batch["text"][:, :3]})
    with pytest.raises(ValueError, match=r"vocabulary is 0..263"):
        trained.check_batch({"image": batch["image"], "text": batch["text"] + 300})
    with pytest.raises(ValueError, match=r"train_text_encoder=True trains a text encoder"):
        DiffusionObjective(model=trained.model, train_text_encoder=True)
    with pytest.raises(ValueError, match=r"frozen text_encoder needs its params"):
        DiffusionObjective(model=trained.model, text_encoder=trained.text_encoder)
