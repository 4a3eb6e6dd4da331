"""On an accelerator: the device's memory as Dew reads it, a fit that does not fit
refused before its first step, plan's verdict and recommendation, and the log's MFU
(model FLOPs, MaxText's count) for the GPT-2-sized model of issue 39.

    source ../shared/tpu/host_env.sh && python3 tools/check_memplan_tpu.py
"""

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

SEQ = 1024
MODEL = CausalTransformer(
    vocab_size=32000, emb_features=1024, num_layers=12, num_heads=16, mlp_features=4096,
    max_seq_len=SEQ, dtype=jnp.bfloat16,
)  # fmt: skip
ONE = MeshSpec(data=1, devices=jax.devices()[:1])


def data(rows):
    batch = {"text": np.random.default_rng(0).integers(0, 32000, (rows, SEQ + 1), np.int32)}
    return Dataset(train=lambda p: itertools.repeat(batch), val=None, records=rows, batch=rows)


print("device", jax.devices()[0].device_kind, "memory", device_memory_bytes(jax.devices()))
objective = LMObjective(model=MODEL, seq_len=SEQ)
shapes = {"text": ((8, SEQ + 1), jnp.int32)}
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
    trainer.fit(data(8), steps=3, log_every=1)
    print("fit at batch 8 ran", seen)
except StepDoesNotFit as error:
    print("fit refused, steps run:", seen, "\n ", str(error)[:700])

start = time.perf_counter()
found = recommend(objective, optax.adamw(1e-4), mesh=ONE, batch=shapes, accumulates=(1, 2, 4))
print(found, f"\n  ({time.perf_counter() - start:.1f} s)")

trainer = Trainer(objective, optax.adamw(1e-4), key=jax.random.key(0), mesh=ONE, progress=False)
trainer.fit(data(4), steps=12, log_every=4)
