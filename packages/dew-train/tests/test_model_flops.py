"""Model FLOPs for MFU as MaxText counts them: a tiny GPT's step against a number
worked by hand, the same with remat on and off, scanned or unrolled, in one
batch or in microbatches; the peaks table by device kind, and an unknown kind."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest

from dew.nn import CausalTransformer, Transformer
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, plan
from dew.train import throughput as tp
from dew.train._programs import Programs
from dew.train.mesh import DEFAULT_RULES
from dew.train.model_flops import AttentionCall, recorded_attention, step_model_flops

ONE = MeshSpec(data=1, devices=jax.devices()[:1])
GPT = dict(vocab_size=32, emb_features=16, num_layers=2, num_heads=2, mlp_features=48)
BATCH, SEQ = 4, 8

# By hand, per token of the forward pass (2 FLOPs a multiply-add; head_dim 8):
#   q, k, v: 3 x 2 x 16 x 16 = 1,536; out: 2 x 16 x 16 = 512;
#   SwiGLU gate, up, down: 3 x 2 x 16 x 48 = 4,608          -> 6,656 a layer
#   2 layers: 13,312; LM head: 2 x 16 x 32 = 1,024           -> 14,336 a token
#   x 32 tokens (4 rows of 8)                                 = 458,752
# attention, per layer: 4 x 4 x 8 x 8 x 2 heads x 8 = 16,384, halved (causal) 8,192;
#   2 layers                                                  = 16,384
# forward 475,136; a training step 3 x forward               = 1,425,408
HAND_WORKED = 1_425_408


def step_flops(model, *, accumulate=1):
    objective = LMObjective(model=model, seq_len=SEQ)
    programs = Programs(
        objective=objective, optimizer=optax.adam(1e-3), mesh=ONE, rules=DEFAULT_RULES
    )
    abstract, _ = programs.state_shardings(None, key=jax.eval_shape(lambda: jax.random.key(0)))
    batch = {"text": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
    with programs.context():
        return step_model_flops(objective, abstract, batch, accumulate=accumulate)


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"use_remat": True},
        {"use_scan": False},
        {"use_scan": False, "use_remat": True},
        {"remat_policy": "save_qkv_proj"},
        {"remat_policy": "minimal"},
    ],
    ids=["scan", "scan+remat", "unrolled", "unrolled+remat", "save_qkv_proj", "minimal"],
)
def test_a_tiny_gpt_step_counts_the_hand_worked_number(variant):
    counted = step_flops(CausalTransformer(**GPT, max_seq_len=SEQ, **variant))
    assert counted.flops == HAND_WORKED
    assert counted.matmuls == 458_752 and counted.attention == 16_384


def test_microbatches_count_the_same_step():
    model = CausalTransformer(**GPT, max_seq_len=SEQ)
    counted = step_flops(model, accumulate=2)
    assert counted.flops == HAND_WORKED and counted.microbatches == 2
    assert counted.matmuls == 458_752 / 2


def test_remat_changes_the_programs_flops_not_the_model_flops():
    """The compiled step with remat recomputes the forward: more products, the same
    model FLOPs (what the MFU divides), in plan as in fit."""
    shapes = {"text": ((BATCH, SEQ + 1), jnp.int32)}
    plans = [
        plan(
            LMObjective(model=CausalTransformer(**GPT, max_seq_len=SEQ, use_remat=r), seq_len=SEQ),
            optax.adam(1e-3),
            mesh=ONE,
            batch=shapes,
        )
        for r in (False, True)
    ]
    assert plans[0].model_flops == plans[1].model_flops == HAND_WORKED
    assert plans[1].flops > plans[0].flops


def test_bidirectional_attention_is_counted_whole():
    with recorded_attention() as calls:
        model = Transformer(**GPT, max_seq_len=SEQ)
        x = jnp.zeros((BATCH, SEQ), jnp.int32)
        jax.eval_shape(model.init, jax.random.key(0), x)
    assert calls and all(not c.is_causal for c in calls)
    assert calls[0].flops == 4 * BATCH * SEQ * SEQ * 2 * 8
    causal = dataclasses.replace(calls[0], is_causal=True)
    assert causal.flops == calls[0].flops / 2
    assert isinstance(causal, AttentionCall)


@dataclasses.dataclass
class FakeDevice:
    device_kind: str
    platform: str = "tpu"


@pytest.mark.parametrize(
    ("kind", "peak"),
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
    ],
)
def test_the_peaks_table_knows_the_chips(kind, peak):
    platform = "tpu" if kind.startswith("TPU") else "gpu"
    total, source = tp.device_peak([FakeDevice(kind, platform)] * 2)
    assert total == 2 * peak and "bf16" in source


def test_an_unknown_chip_shows_mfu_unknown_and_how_to_pass_its_peak(monkeypatch):
    monkeypatch.delenv(tp.PEAK_ENV, raising=False)
    devices = [FakeDevice("TPU v99 prototype")]
    throughput = tp.Throughput(1e12, devices)
    assert math.isnan(throughput.mfu(1.0))
    line = throughput.line()
    assert "MFU unknown" in line and "'TPU v99 prototype'" in line
    assert "Trainer(peak_flops=" in line and tp.PEAK_ENV in line
    given = tp.Throughput(1e12, devices, peak_flops=2e12)
    assert given.mfu(1.0) == 0.5
    monkeypatch.setenv(tp.PEAK_ENV, "4e12")
    assert tp.Throughput(1e12, devices).mfu(1.0) == 0.25
