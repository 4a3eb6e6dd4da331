"""A text encoder trained with the denoiser by Trainer.fit: a second trained role of
DiffusionObjective, optimized (its Adam moments in the optimizer state) and moved by a
few steps, and the pipeline of the run encodes prompts with the moved weights."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from dew.data import ByteTokenizer, Dataset
from dew.nn import models
from dew.nn.testing import TINY_LM
from dew.objectives.diffusion.images import DiffusionObjective
from dew.sampling import FlowSchedule, TextEncoder
from dew.train import MeshSpec, Trainer

CAPTIONS = ["up", "down", "left", "right"]
STEPS = 3


@pytest.mark.slow  # one Trainer compile of DiT + encoder: ~10 s idle, more under load
def test_fit_moves_the_text_encoder_and_the_pipeline_uses_it(tmp_path):
    lm = models.build("causal_transformer", **{**TINY_LM, "vocab_size": 264, "num_layers": 1})
    start = jax.jit(lm.init)(jax.random.key(5), np.zeros((1, 4), np.int32))["params"]
    # the encoder starts from given weights (e.g. a TextEncoder.load), then trains
    encoder = TextEncoder(module=lm, params=start, tokenizer=ByteTokenizer(), max_length=4)
    dit = models.build(
        "dit", sample_size=8, patch_size=4, in_channels=1, emb_features=16, num_layers=1,
        num_heads=2, mlp_features=32, use_scan=False, context_features=16,
    )  # fmt: skip
    objective = DiffusionObjective(
        model=dit, schedule=FlowSchedule(), text_encoder=encoder, train_text_encoder=True, ema=None,
        preview_count=0,
    )  # fmt: skip
    ids = encoder.tokenize(CAPTIONS)

    def train(partition):
        rng = np.random.default_rng(partition.index)
        while True:
            rows = rng.integers(0, 4, 4)
            image = np.where(rows[:, None, None, None] % 2 == 0, 255, 0).astype(np.uint8)
            yield {"image": np.broadcast_to(image, (4, 8, 8, 1)).copy(), "text": ids[rows]}

    trainer = Trainer(
        objective,
        optax.adam(1e-2),
        key=jax.random.key(0),
        mesh=MeshSpec(data=1, devices=jax.devices()[:1]),
        run_dir=str(tmp_path),
        progress=False,
    )
    initial = jax.device_get(nn.meta.unbox(start))
    state = trainer.fit(Dataset(train=train, val=None, records=10**6, batch=4), steps=STEPS)
    params = jax.device_get(state.params)
    assert int(state.updates) == STEPS
    # Adam moves a parameter that got a gradient by ~lr a step. The first step's gradient
    # reaches no context (adaLN-Zero gates are 0), so the encoder moves from step 2, at
    # the tokens of the captions drawn and not dropped; tokens never in a batch stay.
    embed = params["text_encoder"]["embed"]["embedding"] - initial["embed"]["embedding"]
    seen = np.unique(ids)
    moved = np.abs(embed[seen]).max(axis=1) > 1e-3
    assert moved.mean() >= 0.5, moved
    np.testing.assert_array_equal(np.delete(embed, seen, axis=0), 0.0)  # no gradient, no move
    head = params["policy"]["head"]["kernel"]  # zero-initialised (adaLN-Zero), then trained
    assert np.abs(head).max() > 1e-3
    # the optimizer holds moments for the encoder: it is optimized, not frozen
    mu = state.opt_state[0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(state.params)

    pipe = objective.inference_task(state)
    np.testing.assert_array_equal(
        pipe.text_encoder.params["embed"]["embedding"], params["text_encoder"]["embed"]["embedding"]
    )
