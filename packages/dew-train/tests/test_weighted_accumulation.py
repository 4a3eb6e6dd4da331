"""Weighted losses accumulate exactly: a masked LM whose rows carry very
different token counts, and a mixture of experts' per-row balance loss, give
the same loss, metrics and updated parameters at accumulate 1, 2 and 4 on one
device and on 8 devices as one full batch in a hand-written single-device
step (the global masked token mean, computed with optax's cross-entropy).

The rows: even rows keep all 8 targets, odd rows one, so a mean of
per-microbatch means (the old behaviour) is off by several percent.
Tolerance: 1e-6 relative (float32 sums in another order); for parameters,
1e-6 relative to each array's largest entry as well (an entry near zero moves
by the same few float32 ulps of the gradient as its neighbours).
"""

import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM, TINY_MOE
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, Trainer

SEQ, ROWS, LR = 8, 16, 1.0
TINY, MOE = TINY_LM, TINY_MOE
VOCAB = TINY["vocab_size"]
ONE_DEVICE = MeshSpec(data=1, devices=jax.devices()[:1])


def batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    text = rng.integers(0, VOCAB, (ROWS, SEQ + 1)).astype(np.int32)
    mask = np.zeros((ROWS, SEQ + 1), np.int32)
    mask[0::2, 1:] = 1  # 8 targets
    mask[1::2, -1] = 1  # 1 target
    return {"text": text, "mask": mask}


def reference(config):
    """One full-batch sgd step written by hand: masked token mean + 0.01 x the
    mean over rows and layers of the sown per-row balance loss."""
    model = CausalTransformer(**config)
    objective = LMObjective(model=model, seq_len=SEQ, loss_mask_key="mask")
    k_init, _ = jax.random.split(jax.random.key(0))
    params = nn.unbox(jax.jit(objective.init)(k_init))["params"]["policy"]
    b = batch()

    def parts(p):
        logits, sown = model.apply({"params": p}, b["text"][:, :-1], mutable=["intermediates"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, b["text"][:, 1:])
        w = b["mask"][:, 1:].astype(jnp.float32)
        nll_mean = jnp.sum(nll * w) / jnp.sum(w)
        aux = [
            v for path, v in jax.tree_util.tree_leaves_with_path(sown) if "aux_loss" in str(path)
        ]
        aux_mean = (
            jnp.mean(jnp.stack([a.reshape(-1, ROWS) for a in aux]).mean(0).mean(0)) if aux else 0.0
        )
        return nll_mean + 0.01 * aux_mean, (nll_mean, aux_mean, nll)

    # one jitted program (persistently cached), not op-by-op dispatch
    step = jax.jit(jax.value_and_grad(parts, has_aux=True))
    (loss, (nll, aux, tokens)), grads = step(params)
    new = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return float(loss), float(nll), float(aux), new, np.asarray(tokens, np.float64)


def run(config, mesh, accumulate, run_dir):
    b = batch()
    data = Dataset(
        train=lambda p: itertools.repeat({k: v[p.slice(ROWS)] for k, v in b.items()}),
        val=None,
        records=ROWS,
        batch=ROWS,
    )
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**config), seq_len=SEQ, loss_mask_key="mask"),
        optax.sgd(LR),
        key=jax.random.key(0),
        mesh=mesh,
        accumulate=accumulate,
        run_dir=str(run_dir),
        progress=False,
    )
    state = trainer.fit(data, steps=1, log_every=1)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    record = next(r for r in rows if r["kind"] == "train")
    return record, jax.device_get(state.params)


CASES = [
    ("dense", TINY, "one", 1),
    ("dense", TINY, "one", 2),
    ("dense", TINY, "one", 4),
    ("dense", TINY, "eight", 1),
    ("dense", TINY, "eight", 2),
    ("moe", MOE, "one", 4),
    ("moe", MOE, "eight", 2),
]


@pytest.fixture(scope="module")
def references():
    return {"dense": reference(TINY), "moe": reference(MOE)}


@pytest.mark.slow
@pytest.mark.parametrize("name,config,devices,accumulate", CASES)
def test_weighted_rows_accumulate_exactly(name, config, devices, accumulate, references, tmp_path):
    mesh = ONE_DEVICE if devices == "one" else MeshSpec(data=8)
    record, params = run(config, mesh, accumulate, tmp_path)
    loss, nll, aux, want, _ = references[name]
    assert record["loss"] == pytest.approx(loss, rel=1e-6)
    assert record["nll"] == pytest.approx(nll, rel=1e-6)
    assert record["tokens"] == 8 * 8 + 8 * 1
    if name == "moe":
        assert record["aux_loss"] == pytest.approx(aux, rel=1e-6)
        assert 1.0 <= record["aux_loss"] <= MOE["num_experts"]
    else:
        assert "aux_loss" not in record
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(b).max()),
        params,
        want,
    )


def test_a_mean_of_microbatch_means_would_differ(references):
    """The check above can fail: at accumulate=4 the mean of per-microbatch
    means of these rows is far from the global token mean."""
    _, nll, _, _, tokens = references["dense"]
    w = batch()["mask"][:, 1:].astype(np.float64)
    micro = [(tokens[j::4] * w[j::4]).sum() / w[j::4].sum() for j in range(4)]
    assert (tokens * w).sum() / w.sum() == pytest.approx(nll, rel=1e-6)
    assert abs(np.mean(micro) - nll) > 0.01 * nll


def test_masked_out_batch_is_refused_before_compiling(tmp_path):
    b = batch()
    b["mask"][:] = 0
    data = Dataset(train=lambda p: itertools.repeat(b), val=None, records=ROWS, batch=ROWS)
    trainer = Trainer(
        LMObjective(model=CausalTransformer(**TINY), seq_len=SEQ, loss_mask_key="mask"),
        optax.sgd(LR),
        key=jax.random.key(0),
        mesh=ONE_DEVICE,
    )
    with pytest.raises(ValueError, match=r"LMObjective: every target of this batch is masked"):
        trainer.fit(data, steps=1)
    b["mask"][0, 3] = -1
    with pytest.raises(ValueError, match="negative weight"):
        trainer.fit(data, steps=1)
