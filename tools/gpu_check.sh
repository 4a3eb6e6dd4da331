#!/usr/bin/env bash
# One short GPU check of Dew, for when a GPU (an H200) is lent. UNMEASURED: this
# script has not run on a GPU yet (docs/performance.md says so until it has).
#
#   PYTHON=.venv/bin/python tools/gpu_check.sh          # needs jax with CUDA:
#   .venv/bin/pip install -U "jax[cuda12]"              # (same jax version as the lock)
#
# Parts, each bounded by `timeout` so the whole stays well under 10 minutes:
#   1. a ~1.06B-parameter Llama-style decoder (emb 2048, 18 layers, 16 heads,
#      SwiGLU 5632, vocab 32000), bf16 compute with float32 master weights and
#      adamw state, seq 2048 x batch 8, 30 steps: tokens/s and MFU from Dew's
#      own log lines (MFU against the H200's 989 TFLOP/s bf16 dense peak);
#   2. the seed program (examples/quickstart.py) on the GPU: its last line;
#   3. one DiT step of DiffusionObjective (if dew.objectives.diffusion exists).
# Prints one summary line:  GPU_CHECK device=... lm_tokens_s=... lm_mfu=... seed=... diffusion=...
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

timeout 420 "$PY" - > "$OUT/lm.log" 2>&1 <<'EOF'
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Dataset, Trainer, models
from dew.objectives.lm import LMObjective

print("device", jax.devices()[0].device_kind, flush=True)
SEQ, BATCH, VOCAB = 2048, 8, 32000
model = models.build(
    "causal_transformer",
    vocab_size=VOCAB,
    emb_features=2048,
    num_layers=18,
    num_heads=16,
    mlp_features=5632,
    max_seq_len=SEQ,
    dtype=jnp.bfloat16,
    param_dtype=jnp.float32,
)
rows = np.random.default_rng(0).integers(0, VOCAB, (4, BATCH, SEQ + 1)).astype(np.int32)
data = Dataset(
    train=lambda p: ({"text": r} for r in itertools.cycle(rows)),
    val=None,
    records=4 * BATCH,
    batch=BATCH,
)
trainer = Trainer(
    LMObjective(model, seq_len=SEQ), optax.adamw(1e-4), key=jax.random.key(0), progress=False
)
trainer.fit(data, steps=30, log_every=10)
EOF
LM_RC=$?

timeout 120 "$PY" examples/quickstart.py > "$OUT/seed.log" 2>&1
SEED_RC=$?

DIFF="absent"
if "$PY" -c "import dew.objectives.diffusion" 2>/dev/null; then
  timeout 120 "$PY" - > "$OUT/diffusion.log" 2>&1 <<'EOF'
import itertools

import jax
import numpy as np
import optax

from dew import Dataset, Trainer
from dew.nn import DiT
from dew.objectives.diffusion import DiffusionObjective

dit = DiT(sample_size=32, patch_size=2, in_channels=3, emb_features=384, num_layers=12,
          num_heads=6, mlp_features=1536, num_classes=10)
images = np.random.default_rng(0).integers(0, 256, (64, 32, 32, 3)).astype(np.uint8)
labels = np.arange(64, dtype=np.int32) % 10
data = Dataset(
    train=lambda p: itertools.repeat({"image": images, "label": labels}),
    val=None, records=64, batch=64,
)
trainer = Trainer(DiffusionObjective(dit), optax.adamw(1e-4), key=jax.random.key(0),
                  progress=False)
trainer.fit(data, steps=20, log_every=10)
EOF
  DIFF_RC=$?
  DIFF=$(grep -E "^step 20:" "$OUT/diffusion.log" | sed -E 's/.*loss ([^,]+), ([0-9,.]+ examples\/s), MFU ([^ ]+).*/loss=\1,\2,mfu=\3/' | tr -d ' ')
  [ -z "$DIFF" ] && DIFF="failed(rc=$DIFF_RC)"
fi

DEVICE=$(grep -m1 "^device" "$OUT/lm.log" | cut -d' ' -f2- | tr ' ' '_')
LAST=$(grep -E "^step 30:" "$OUT/lm.log")
TOKENS=$(echo "$LAST" | sed -nE 's/.* ([0-9,]+) tokens\/s.*/\1/p' | tr -d ,)
MFU=$(echo "$LAST" | sed -nE 's/.*MFU ([0-9.]+%|n\/a).*/\1/p')
SEED=$(tail -1 "$OUT/seed.log" | tr ' ' '_')
[ $LM_RC -ne 0 ] && TOKENS="failed(rc=$LM_RC)"
[ $SEED_RC -ne 0 ] && SEED="failed(rc=$SEED_RC)"
echo "GPU_CHECK device=${DEVICE:-unknown} lm_tokens_s=${TOKENS:-none} lm_mfu=${MFU:-none} seed=${SEED:-none} diffusion=${DIFF} logs=$OUT"
