"""Starting a run imports only what it uses: ``import dew`` and the names of the
quickstart (Trainer, Dataset, LMObjective, generate) leave Grain, Orbax,
TensorBoard and tqdm unloaded until a reader, a checkpoint, a run directory or
a progress bar needs them (each costs startup time; Grain with the Orbax it
loads was about a second of the time to the first step)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("grain", "orbax", "tensorboardX", "tqdm", "transformers", "torch", "datasets", "av")


def test_quickstart_imports_leave_the_heavy_modules_unloaded():
    code = (
        "import json, sys\n"
        "import dew\n"
        "from dew import Dataset, Trainer, models\n"
        "from dew.objectives.language.lm import LMObjective\n"
        "from dew.sampling import generate\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
