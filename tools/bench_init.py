"""The trainer's compiled initialisation at XLA:CPU's LLVM O1 (what ``Trainer`` uses on
a CPU, ``dew.train.trainer.INIT_CPU_OPTIONS``) against XLA's default O2 and O0: compile
seconds and whether the initial values equal O2's bit for bit (docs/performance.md,
"Peer suite", the first step).

One process, the persistent compilation cache off; the init program of a peer-suite
trainer (tools/bench_peers/jax_sides.py), compiled once per level, O1 first (so it
carries any one-time warm-up).

    python tools/bench_init.py --size medium --variant dew_gpt2
    /work/venv313/bin/python tools/bench_init.py --size seed --variant dew_seed
"""

from __future__ import annotations

import os

os.environ["JAX_COMPILATION_CACHE_DIR"] = ""  # compile every time

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parent / "bench_peers"))

import jax  # noqa: E402
import jax_sides  # noqa: E402
import numpy as np  # noqa: E402
import protocol  # noqa: E402

from dew.train.mesh import unbox_abstract  # noqa: E402
from dew.train.trainer import INIT_CPU_OPTIONS  # noqa: E402

LEVELS = (("O1", INIT_CPU_OPTIONS), ("O2", None), ("O0", {"xla_backend_optimization_level": 0}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=sorted(protocol.SIZES))
    parser.add_argument("--variant", default="dew_gpt2", choices=("dew_gpt2", "dew_seed"))
    args = parser.parse_args(argv)
    trainer, _ = jax_sides.dew_trainer(args.size, args.variant)
    _, shardings = trainer.state_shardings(None)
    closed, treedef = next(iter(trainer.programs.cache.init_jaxprs.values()))

    def create(key):
        leaves = jax.extend.core.jaxpr_as_fun(closed)(key)
        return unbox_abstract(jax.tree.unflatten(treedef, leaves))

    values = {}
    for name, options in LEVELS:
        with trainer.programs.context():
            begin = time.perf_counter()
            compiled = (
                jax.jit(create, out_shardings=shardings, compiler_options=options)
                .lower(trainer.key)
                .compile()
            )
            seconds = time.perf_counter() - begin
            values[name] = [np.asarray(x) for x in jax.tree.leaves(compiled(trainer.key).params)]
        print(f"{name}: compiled in {seconds:.2f} s", flush=True)
    for name in ("O1", "O0"):
        same = all(np.array_equal(a, b) for a, b in zip(values[name], values["O2"]))
        print(f"{name} values equal O2's bit for bit: {same}")


if __name__ == "__main__":
    main()
