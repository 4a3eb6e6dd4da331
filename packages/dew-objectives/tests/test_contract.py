"""Every objective through the contract: compiles, finite loss and gradients,
same key same loss, metrics are scalars. (More families join this list.)"""

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
    return LMObjective(model, seq_len=8), batch


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
        encoder, predictor, planned_updates=10, masks=MultiBlock(num_targets=2, min_keep=4)
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
    return DPOObjective(model, rpo_alpha=0.1), batch


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


class _SeedInit(Objective):
    """The seed's ``init(key)``: the trainer's ``initialize`` must not pass a spec."""

    model = None
    calls: list

    def __init__(self):
        self.calls = []

    def init(self, key):
        self.calls.append(())
        return {"params": {}}


class _SpecInit(_SeedInit):
    init_reads_spec = True

    def init(self, key, spec=None):
        self.calls.append((spec,))
        return {"params": {}}


def test_initialize_follows_the_declared_init_form_not_its_signature():
    spec = {"x": ((3,), np.float32)}
    seed, reads = _SeedInit(), _SpecInit()
    seed.initialize(jax.random.key(0), spec)
    reads.initialize(jax.random.key(0), spec)
    reads.initialize(jax.random.key(0), None)  # no spec declared: the seed's call
    assert seed.calls == [()] and reads.calls == [(spec,), (None,)]
    assert LMObjective.init_reads_spec and not Objective.init_reads_spec
    # the trainer's own accumulation applies unless an objective derives one
    assert seed.accumulate_for(8) is None
