"""What the objective cores give a user through Trainer.fit: a failed first-ratio
check is a RatioError, the family's headline metrics are on the printed line,
and a dataset whose spec does not fit the objective's declared fields is
refused before anything is compiled."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset, Field
from dew.nn.backbones import CausalTransformer
from dew.objectives.cores.rewards import TokenReward
from dew.objectives.cores.rl import RatioError
from dew.objectives.rl.grpo import GRPOObjective
from dew.sampling import Sampling
from dew.train import MeshSpec, Trainer

V, PROMPTS = 16, 4
MODEL = CausalTransformer(
    vocab_size=V, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=8
)
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def sevens(completion, mask, batch):
    return jnp.sum((completion == 7) & mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)


def prompts(partition):
    rng = np.random.default_rng(0)
    while True:
        yield {
            "prompt": rng.integers(0, V, (PROMPTS, 1)).astype(np.int32),
            "prompt_mask": np.ones((PROMPTS, 1), bool),
        }


SPEC = {"prompt": Field((1,), np.int32), "prompt_mask": Field((1,), np.bool_)}
DATA = Dataset(train=prompts, val=None, records=0, batch=PROMPTS, spec=SPEC)


def grpo(**kw):
    return GRPOObjective(
        model=MODEL,
        rewards=[TokenReward(fn=sevens)],
        group_size=4,
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        check_first_ratio=True,
        **kw,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ScoredAtAnotherTemperature(GRPOObjective):
    """The reconstruction bug the check exists for (TRL #454): the loss scores the
    completions at another temperature than the sampler drew them at."""

    def loss(self, variables, batch, step):
        elsewhere = dataclasses.replace(self, sampling=Sampling(temperature=0.5))
        return super(ScoredAtAnotherTemperature, elsewhere).loss(variables, batch, step)


def test_headline_metrics_are_printed_and_a_bad_first_ratio_is_a_ratio_error(capsys):
    trainer = Trainer(grpo(), optax.adam(1e-3), key=jax.random.key(0), mesh=ONE)
    trainer.fit(DATA, steps=2, log_every=1)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert len(lines) == 2, lines
    for line in lines:  # "step 1: loss -0.0000, reward 0.0833, kl 0.0000, 1,234 tokens/s, ..."
        head = line.split(", ")
        assert head[1].startswith("reward ") and head[2].startswith("kl "), line
        assert 0.0 <= float(head[1].split()[1]) <= 1.0 and float(head[2].split()[1]) >= 0.0

    broken = ScoredAtAnotherTemperature(
        model=MODEL,
        rewards=[TokenReward(fn=sevens)],
        group_size=4,
        max_new_tokens=3,
        sampling=Sampling(temperature=1.0),
        check_first_ratio=True,
    )
    trainer = Trainer(broken, optax.adam(1e-3), key=jax.random.key(0), mesh=ONE)
    with pytest.raises(RatioError, match=r"ScoredAtAnotherTemperature: the first update"):
        trainer.fit(DATA, steps=1, log_every=1)


def test_a_spec_that_does_not_fit_the_declared_fields_is_refused_before_compiling():
    wrong = dict(SPEC, prompt_mask=Field((2,), np.bool_))
    data = Dataset(train=prompts, val=None, records=0, batch=PROMPTS, spec=wrong)
    trainer = Trainer(grpo(), optax.adam(1e-3), key=jax.random.key(0), mesh=ONE)
    with pytest.raises(
        ValueError,
        match=r"batch\['prompt_mask'\] has shape \[rows, 2\], but GRPOObjective reads "
        r"\[rows, prompt_len = 1\]",
    ):
        trainer.fit(data, steps=1)
    floats = dict(SPEC, prompt=Field((1,), np.float32))
    data = Dataset(train=prompts, val=None, records=0, batch=PROMPTS, spec=floats)
    with pytest.raises(TypeError, match=r"batch\['prompt'\] holds float32, but GRPOObjective"):
        trainer.fit(data, steps=1)


def _diffusion_case():
    from dew.nn import DiT
    from dew.nn.testing import TINY_DIT
    from dew.objectives.diffusion.images import DiffusionObjective

    spec = {"image": Field((8, 8, 3), np.uint8), "label": Field((), np.int32)}
    return DiffusionObjective(model=DiT(**TINY_DIT, num_classes=10)), spec, "label"


def _jepa_case():
    from dew.nn import ViT, ViTPredictor
    from dew.nn.testing import TINY_PREDICTOR, TINY_VIT
    from dew.objectives.jepa.jepa import JepaObjective
    from dew.objectives.jepa.masks import MultiBlock

    objective = JepaObjective(
        encoder=ViT(**TINY_VIT),
        predictor=ViTPredictor(**TINY_PREDICTOR),
        planned_updates=2,
        masks=MultiBlock(num_targets=2, min_keep=2),
    )
    spec = {"image": Field((12, 12, 3), np.uint8), "label": Field((), np.int32)}
    return objective, spec, "image"


def _classifier_distillation_case():
    import flax.linen as nn

    from dew.objectives.language.classifier_distillation import ClassifierDistillationObjective

    teacher = nn.Dense(4)
    params = teacher.init(jax.random.key(1), np.zeros((1, 3), np.float32))["params"]
    objective = ClassifierDistillationObjective(
        student=nn.Dense(4), teacher=teacher, teacher_params=params
    )
    spec = {"image": Field((3,), np.float32), "label": Field((), np.int32)}
    return objective, spec, "image"


MISSING = {
    "diffusion": _diffusion_case,
    "jepa": _jepa_case,
    "classifier_distillation": _classifier_distillation_case,
}


@pytest.mark.parametrize("family", sorted(MISSING))
def test_a_missing_declared_field_is_refused_by_fit_before_compiling(family):
    """Diffusion, JEPA and classifier distillation declare their fields
    (``batch_fields``) as LM, DPO, GRPO and PPO do: a dataset whose spec lacks one is
    refused by ``fit`` with the one generic error, before anything is compiled."""
    objective, spec, missing = MISSING[family]()
    spec = {k: v for k, v in spec.items() if k != missing}

    def train(partition):
        while True:
            yield {k: np.zeros((4, *f.shape), f.dtype) for k, f in spec.items()}

    data = Dataset(train=train, val=None, records=0, batch=4, spec=spec)
    trainer = Trainer(objective, optax.sgd(0.1), key=jax.random.key(0), mesh=ONE)
    name = type(objective).__name__
    with pytest.raises(KeyError, match=rf"{name} reads batch\['{missing}'\] .*which the data"):
        trainer.fit(data, steps=1)
    cache = trainer.programs.cache
    assert not cache.init and not cache.update and not cache.prepare  # nothing compiled
