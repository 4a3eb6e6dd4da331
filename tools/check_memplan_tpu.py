"""On an accelerator: the device's memory as Dew reads it, a fit that does not fit
refused before its first step, plan's verdict and recommendation, and the log's MFU
(model FLOPs, MaxText's count) for the GPT-2-sized model of issue 39.

    source ../shared/tpu/host_env.sh && python3 tools/check_memplan_tpu.py [--too-big 24]
        [--scan] [--no-recommend]

``--too-big``: the batch that should not fit (checked with plan and fit before the
run at batch 8); ``--scan``: the scanned stack as one compiled loop
(``unroll_layers=False``: a 40 s compile on a v5e, against minutes straight).
"""

import argparse
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew.data import Dataset
from dew.nn import CausalTransformer
from dew.objectives.language.lm import LMObjective
from dew.train import MeshSpec, StepDoesNotFit, Trainer, plan, recommend
from dew.train.memory import device_memory_bytes

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--too-big", type=int, default=8)
ARGS.add_argument("--scan", action="store_true")
ARGS.add_argument("--no-recommend", action="store_true")
ARGS = ARGS.parse_args()
SEQ = 1024
MODEL = CausalTransformer(
    vocab_size=32000, emb_features=1024, num_layers=12, num_heads=16, mlp_features=4096,
    max_seq_len=SEQ, dtype=jnp.bfloat16, unroll_layers=False if ARGS.scan else None,
)  # fmt: skip
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def data(rows):
    batch = {"text": np.random.default_rng(0).integers(0, 32000, (rows, SEQ + 1), np.int32)}
    return Dataset(train=lambda p: itertools.repeat(batch), val=None, records=rows, batch=rows)


print("device", jax.devices()[0].device_kind, "memory", device_memory_bytes(jax.devices()))
objective = LMObjective(model=MODEL, seq_len=SEQ)
shapes = {"text": ((ARGS.too_big, SEQ + 1), jnp.int32)}
start = time.perf_counter()
try:
    print(plan(objective, optax.adamw(1e-4), mesh=ONE, batch=shapes))
except StepDoesNotFit as error:
    print("plan: StepDoesNotFit:", str(error)[:600])
print(f"  ({time.perf_counter() - start:.1f} s)")

trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), mesh=ONE, progress=False)
seen = []
trainer.add_hook(lambda info: seen.append(info.step))
try:
    trainer.fit(data(ARGS.too_big), steps=3, log_every=1)
    print(f"fit at batch {ARGS.too_big} ran", seen)
except StepDoesNotFit as error:
    print("fit refused, steps run:", seen, "\n ", str(error)[:700])

trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), mesh=ONE, progress=False)
start = time.perf_counter()
trainer.fit(data(8), steps=12, log_every=4)
print(f"fit at batch 8: 12 steps in {time.perf_counter() - start:.1f} s")

if not ARGS.no_recommend:
    start = time.perf_counter()
    found = recommend(objective, optax.adamw(1e-4), mesh=ONE, batch=shapes, accumulates=(1, 2, 4))
    print(found, f"\n  ({time.perf_counter() - start:.1f} s)")
