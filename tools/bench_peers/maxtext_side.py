"""MaxText side of the peer suite: MaxText's own pre-training entry point
(``maxtext.trainers.pre_train.train.main``: its decoder, its train step, its
loop) on its synthetic data, with config overrides for the suite's width and
depth (Llama-style decoder: RMSNorm, RoPE, SwiGLU; so run.py compares it
with ``dew_llama``). Its per-step wall times come from its own log line
(``completed step: N, seconds: S``); time to first step is when step 0's line
is logged, from process start. Greedy generation is not measured: MaxText
decodes through its inference engine with a tokenizer asset, not a call on
token ids.

Install (outside the repository; MaxText 0.2.5 needs Python >= 3.12 and lists
its dependencies only under accelerator extras, so the base list is installed
without jax's TPU/GPU builds):

    uv venv -p /root/.pyenv/versions/3.12.1/bin/python3 /work/peers/maxtext
    VIRTUAL_ENV=/work/peers/maxtext uv pip install maxtext "jax[cpu]"
    R=/work/peers/maxtext/lib/python3.12/site-packages/dependencies/requirements
    grep -vxE 'jax|jaxlib|pre-commit|pylint|pytype|pyink|pytest|coverage' \\
        $R/base_requirements/requirements.txt > /tmp/maxtext-reqs.txt
    VIRTUAL_ENV=/work/peers/maxtext uv pip install -r /tmp/maxtext-reqs.txt jinja2 "jax[cpu]"

    /work/peers/maxtext/bin/python tools/bench_peers/maxtext_side.py --size seed

Prints ``RESULT {json}``.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import protocol  # noqa: E402

STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+)")


class Steps(logging.Handler):
    """Records ``(step, seconds, time logged)`` from MaxText's step lines."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, float, float]] = []

    def emit(self, record):
        m = STEP.search(record.getMessage())
        if m:
            self.seen.append((int(m.group(1)), float(m.group(2)), time.perf_counter()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    protocol.check_size(args.size)
    s = protocol.SIZES[args.size]
    import maxtext
    from maxtext.trainers.pre_train import train

    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    out = tempfile.mkdtemp(prefix="maxtext-bench-")
    overrides = dict(
        run_name="bench", base_output_directory=out, dataset_type="synthetic",
        steps=args.steps, hardware="cpu", base_emb_dim=s["emb"],
        base_num_query_heads=s["heads"], base_num_kv_heads=s["heads"],
        base_mlp_dim=s["mlp"], base_num_decoder_layers=s["layers"],
        head_dim=s["emb"] // s["heads"], max_target_length=s["seq"],
        per_device_batch_size=s["batch"], vocab_size=protocol.VOCAB,
        enable_checkpointing=False, log_period=1, skip_jax_distributed_system=True,
        learning_rate=3e-3, opt_type="adamw",
    )  # fmt: skip
    steps = Steps()
    logging.getLogger().addHandler(steps)
    logging.getLogger().setLevel(logging.INFO)
    clock = protocol.Clock()
    train.main(["train", str(base), *(f"{k}={v}" for k, v in overrides.items())])
    seen = sorted(steps.seen)
    if len(seen) < 2:
        raise SystemExit(f"MaxText logged {len(seen)} step lines; expected {args.steps}")
    first = seen[0][2] - START
    step = statistics.median(x[1] for x in seen[1:])
    _, cpu = clock.per(args.steps)  # whole run, compile included: an upper bound
    result = protocol.result(args.size, first, step, cpu, float("nan"),
                             note="its own trainer; generation not measured")  # fmt: skip
    protocol.emit("maxtext", result)


if __name__ == "__main__":
    main()
