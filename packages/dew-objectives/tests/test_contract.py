"""Every objective through the contract: compiles, finite loss and gradients,
same key same loss, metrics are scalars. (More families join this list.)"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dew.nn import CausalTransformer
from dew.objectives import Objective, Step
from dew.objectives.contract import weighted
from dew.objectives.language.lm import LMObjective


def lm_case():
    model = CausalTransformer(
        vocab_size=24, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16
    )
    batch = {"text": np.random.default_rng(0).integers(0, 24, (4, 9)).astype(np.int32)}
    return LMObjective(model=model, seq_len=8), batch


def jepa_case():
    from dew.nn import ViT, ViTPredictor
    from dew.objectives.jepa.jepa import JepaObjective
    from dew.objectives.jepa.masks import MultiBlock

    grid = dict(image_size=8, patch_size=2, num_channels=1, position_embedding="learned")
    encoder = ViT(emb_features=16, num_layers=1, num_heads=2, mlp_features=32, **grid)
    predictor = ViTPredictor(
        encoder_features=16, emb_features=8, num_layers=1, num_heads=2, mlp_features=16, **grid
    )
    objective = JepaObjective(
        encoder=encoder,
        predictor=predictor,
        planned_updates=10,
        masks=MultiBlock(num_targets=2, min_keep=4),
    )
    batch = {"image": np.random.default_rng(0).integers(0, 256, (4, 8, 8, 1)).astype(np.uint8)}
    return objective, batch


def dpo_case():
    from dew.objectives.preference.dpo import DPOObjective

    model = CausalTransformer(
        vocab_size=24, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=16
    )
    rng = np.random.default_rng(0)
    ids = {k: rng.integers(1, 24, (4, 8)).astype(np.int32) for k in ("chosen", "rejected")}
    ids["rejected"][:, :3] = ids["chosen"][:, :3]  # a shared 3-token prompt
    mask = np.arange(8)[None].repeat(4, 0) >= 3
    batch = dict(ids, chosen_mask=mask, rejected_mask=mask, prompt_mask=~mask)
    return DPOObjective(model=model, rpo_alpha=0.1), batch


CASES = {"lm": lm_case, "jepa": jepa_case, "dpo": dpo_case}


@pytest.mark.parametrize("name", sorted(CASES))
def test_objective_contract(name):
    objective, batch = CASES[name]()
    assert isinstance(objective, Objective)
    variables = nn.unbox(objective.init(jax.random.key(0)))
    objective.check_batch(batch)

    rows = len(next(iter(batch.values())))

    @jax.jit
    def loss_and_grad(params, key):
        step = Step(index=jnp.int32(3), key=key)

        def value(p):
            loss, metrics = objective.loss({**variables, "params": p}, batch, step)
            terms = weighted.loss_terms(loss, rows)
            return weighted.loss_value(terms), weighted.reduce(weighted.as_metrics(metrics, rows))

        return jax.value_and_grad(value, has_aux=True)(params)

    (loss, metrics), grads = loss_and_grad(variables["params"], jax.random.key(1))
    (loss_again, _), _ = loss_and_grad(variables["params"], jax.random.key(1))
    assert np.isfinite(float(loss))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
    assert float(loss) == float(loss_again)
    assert all(jnp.ndim(v) == 0 and np.isfinite(float(v)) for v in metrics.values())


def _init_forms():
    """Fresh classes (a class warns once): the seed's ``init(key)`` and the one form."""

    class SeedInit(Objective):
        model = None

        def __init__(self):
            self.calls = []

        def init(self, key):
            self.calls.append(())
            return {"params": {}}

    class SpecInit(SeedInit):
        def init(self, key, spec=None):
            self.calls.append((spec,))
            return {"params": {}}

    return SeedInit(), SpecInit()


def test_init_has_one_form_and_the_seed_form_runs_with_one_warning():
    spec = {"x": ((3,), np.float32)}
    seed, reads = _init_forms()
    with pytest.warns(DeprecationWarning) as caught:
        seed.initialize(jax.random.key(0), spec)
        seed.initialize(jax.random.key(0), None)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert messages == [
        "SeedInit.init(self, key) is the seed's form; write init(self, key, spec=None) "
        "(spec: the data's batch spec, None when it declares none)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reads.initialize(jax.random.key(0), spec)
        reads.initialize(jax.random.key(0), None)
    assert seed.calls == [(), ()] and reads.calls == [(spec,), (None,)]
    # the trainer's own accumulation applies unless an objective derives one
    assert seed.accumulate_for(8) is None


class _Prepares(Objective):
    model = None

    def prepare(self, variables, batch, step):
        return batch


def test_the_phases_are_declared_and_the_trainer_reads_the_declaration():
    class Three(_Prepares):
        phases = ("prepare", "prepare_host", "prepare_finish")

        def prepare_host(self, rollout):
            return {}

        def prepare_finish(self, variables, batch, step):
            return batch

    class Settled(_Prepares):  # defines prepare, declares none: no prepare phase
        phases = ()

    three, settled = Three(), Settled()
    assert three.has_prepare and three.has_prepare_host
    assert not settled.has_prepare and not settled.has_prepare_host
    assert not Objective().has_prepare and not Objective().has_evaluate


def test_a_declared_phase_the_class_does_not_define_is_an_error_when_it_is_made():
    with pytest.raises(
        TypeError,
        match=r"Host declares the phase\(s\) \['prepare_host'\] but "
        r"does not define prepare_host\(self, rollout\)",
    ):

        class Host(_Prepares):
            phases = ("prepare", "prepare_host")

    with pytest.raises(ValueError, match="declares 'prepare_host' without 'prepare'"):

        class Alone(Objective):
            phases = ("prepare_host",)

    with pytest.raises(ValueError, match=r"names \['rollout'\]: the phases are"):

        class Unknown(Objective):
            phases = ("rollout",)

    class Later(Objective):  # a property: checked when the trainer reads it
        model = None

        @property
        def phases(self):
            return ("prepare",)

    with pytest.raises(TypeError, match=r"Later declares the phase\(s\) \['prepare'\]"):
        Later().has_prepare  # noqa: B018


def test_a_seed_objective_that_overrides_prepare_without_declaring_still_prepares():
    class Seed(_Prepares):
        pass

    with pytest.warns(DeprecationWarning, match=r"write phases = \('prepare',\)"):
        assert Seed().has_prepare
    assert not Seed().has_prepare_host


def test_pipeline_is_the_old_name_of_inference_task():
    class Exports(Objective):
        model = None

        def export(self, variables):
            return variables

    class State:
        def variables(self, averaged):
            return {"averaged": averaged}

    objective = Exports()
    assert objective.inference_task(State()) == {"averaged": False}  # it keeps no average
    with pytest.warns(DeprecationWarning, match=r"Exports.pipeline\(state\) is now inference_task"):
        assert objective.pipeline(State()) == {"averaged": False}


def test_ema_is_frozen_and_validates_only():
    """``EMA`` keeps its fields as given (a numpy number stays one) and validates them;
    nothing is written back, and its decay schedule is the same number either way."""
    import dataclasses

    from dew.objectives import EMA

    ema = EMA(decay=np.float32(0.5), warmup_steps=np.int64(4))
    assert type(ema.decay) is np.float32 and type(ema.warmup_steps) is np.int64  # as given
    again = dataclasses.replace(ema)
    for field in dataclasses.fields(ema):
        assert getattr(again, field.name) is getattr(ema, field.name), field.name
    assert float(ema.decay_at(2)) == float(EMA(decay=0.5, warmup_steps=4).decay_at(2)) == 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        ema.decay = 0.9
