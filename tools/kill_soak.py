"""Kill soak: SIGKILL a checkpointing run at random moments, resume it, and
compare the final state bit for bit with a run that was never killed.

    python tools/kill_soak.py --kills 30 --seed 0          # the soak in docs/save-and-resume.md
    python tools/kill_soak.py --kills 2 --per-directory 2  # a short soak of random kills

CI runs this module's run with fixed kills (tests/test_kill_soak.py).

The run (``--child``): a tiny causal LM trained by ``Trainer.fit`` with a
warm-up + cosine learning-rate schedule, ``clip_by_global_norm``, AdamW,
``Trainer(accumulate=2)``, an EMA of the weights, a Grain reader
(``dew.data.TokenWindows`` over a small text file, position saved in every
checkpoint), evaluation every 4 steps and asynchronous checkpoints every 3
(``keep=2``).

Each kill is one of, chosen at random:

- ``startup``: at a random time after the process starts (imports, restore,
  compilation, or the first steps), up to 60% of an uninterrupted run's wall time;
- ``step``: when the trainer asks for batch N of this process (the step
  before it still in flight);
- ``write``: a random 0-40 ms after ``<step>.orbax-checkpoint-tmp`` appears
  (an asynchronous checkpoint being written);
- ``eval``: when evaluation asks for its k-th batch in this process.

``--per-directory`` kills hit one directory in a row (each restart resumes
what the one before left), then a run without a kill finishes it; its final
state (params, optimizer state, EMA, key, counters) must equal the
uninterrupted run's array for array, bit for bit. A kill that did not land
(the run finished first) is not counted, and ends its sequence. Exit status 0
when every sequence was exact, 1 otherwise; ``--json`` writes every event.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

STEPS, EVERY, EVAL_EVERY, SEQ, BATCH = 12, 3, 4, 16, 8
TMP = re.compile(r"^\d+\.orbax-checkpoint-tmp")
KINDS = ("startup", "step", "write", "eval")


# ------------------------------------------------------------------ the run
def corpus(path: pathlib.Path) -> None:
    """A small deterministic text file (about 6 KB)."""
    words = "dew trains jax models and checkpoints keep every run exact across kills".split()
    rng = random.Random(0)
    path.write_text(" ".join(rng.choice(words) for _ in range(1200)))


def kill_self(why: str) -> None:
    print(f"soak child: SIGKILL {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class Counting:
    """An iterator that sends this process SIGKILL when item ``at`` is asked
    for (counting from 1), forwarding ``get_state``/``set_state``."""

    def __init__(self, inner, at: int | None, what: str, counter: list[int]):
        self.inner, self.at, self.what, self.counter = inner, at, what, counter
        if hasattr(inner, "get_state"):
            self.get_state, self.set_state = inner.get_state, inner.set_state

    def __iter__(self):
        return self

    def __next__(self):
        self.counter[0] += 1
        if self.at is not None and self.counter[0] == self.at:
            kill_self(f"at {self.what} {self.at}")
        return next(self.inner)


def watch_writes(directory: str, delay: float) -> None:
    """SIGKILL ``delay`` seconds after an Orbax temporary directory appears.

    One left by an earlier kill (there when this process starts, until the restore
    sets it aside) is not a write of this run: waiting for a new one keeps a
    ``write`` kill from landing at start-up."""

    def listing() -> set[str]:
        try:
            return {n for n in os.listdir(directory) if TMP.match(n)}
        except FileNotFoundError:
            return set()

    leftover = listing()

    def run():
        while True:
            if listing() - leftover:
                time.sleep(delay)
                kill_self(f"{delay * 1000:.0f} ms into a checkpoint write")
            time.sleep(0.002)

    threading.Thread(target=run, daemon=True).start()


def child(args) -> None:
    start = time.perf_counter()
    kind, _, value = (args.kill or "none:").partition(":")
    if kind == "startup":
        threading.Timer(float(value), kill_self, (f"{float(value):.2f} s after start",)).start()

    import jax
    import numpy as np
    import optax

    from dew import Checkpoints, Trainer, models
    from dew.data import ByteTokenizer, Dataset, TokenWindows
    from dew.objectives import EMA
    from dew.objectives.language.lm import LMObjective

    tokenizer = ByteTokenizer()
    windows = TokenWindows(
        args.corpus, SEQ, tokenizer=tokenizer, seed=1, val_fraction=0.1, cache_dir=args.cache
    )
    loaded = windows.load(batch=BATCH)
    counters = {"train": [0], "eval": [0]}
    at_batch = int(value) if kind == "step" else None
    at_eval = int(value) if kind == "eval" else None
    data = Dataset(
        train=lambda p: Counting(loaded.train(p), at_batch, "batch", counters["train"]),
        val=lambda p: Counting(loaded.val(p), at_eval, "eval batch", counters["eval"]),
        records=loaded.records,
        batch=BATCH,
    )
    model = models.build(
        "causal_transformer",
        vocab_size=tokenizer.vocab_size,
        emb_features=32,
        num_layers=1,
        num_heads=2,
        mlp_features=64,
        max_seq_len=SEQ,
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 3, STEPS, end_value=3e-4)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(schedule))
    trainer = Trainer(
        LMObjective(model=model, seq_len=SEQ, ema=EMA(decay=0.9)),
        optimizer,
        key=jax.random.key(0),
        accumulate=2,
        progress=False,
        checkpoints=Checkpoints(args.dir, keep=2),
    )
    if kind == "write":
        watch_writes(args.dir, float(value))
    state = trainer.fit(
        data,
        steps=STEPS,
        log_every=1,
        eval_every=EVAL_EVERY,
        eval_batches=2,
        checkpoint_every=EVERY,
    )
    leaves = {
        f"{field}{jax.tree_util.keystr(path)}": np.asarray(leaf)
        for field in ("params", "opt_state", "averaged")
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, field))
    }
    leaves["key"] = np.asarray(jax.random.key_data(state.key))
    for name in ("step", "microstep", "updates"):
        leaves[name] = np.asarray(getattr(state, name))
    np.savez(args.out, **leaves)
    print(f"soak child: done in {time.perf_counter() - start:.1f} s", flush=True)


# --------------------------------------------------------------- the soak
def run_child(work: pathlib.Path, directory, out, kill: str | None, timeout: float):
    command = [sys.executable, __file__, "--child", "--dir", str(directory), "--out", str(out)]
    command += ["--corpus", str(work / "corpus.txt"), "--cache", str(work / "tokens")]
    if kill:
        command += ["--kill", kill]
    env = dict(os.environ)
    # one CPU device wherever it runs (pytest's conftest emulates 8): the same program
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/dew/jax-compilation"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return done, time.perf_counter() - began


def draw_kill(rng: random.Random, wall: float) -> str:
    kind = rng.choice(KINDS)
    if kind == "startup":
        return f"startup:{rng.uniform(0.0, 0.6 * wall):.2f}"
    if kind == "step":
        return f"step:{rng.randint(1, STEPS)}"
    if kind == "write":
        return f"write:{rng.uniform(0.0, 0.04):.3f}"
    return f"eval:{rng.randint(1, 2 * (STEPS // EVAL_EVERY))}"


def same(a_path, b_path) -> list[str]:
    """Names of the arrays that differ (bits, shape or dtype) between two .npz."""
    import numpy as np

    a, b = np.load(a_path), np.load(b_path)
    if sorted(a.files) != sorted(b.files):
        return [f"array names differ: {sorted(set(a.files) ^ set(b.files))}"]
    return [
        n
        for n in a.files
        if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or a[n].tobytes() != b[n].tobytes()
    ]


def summary_of(out: str) -> str:
    """What a resumed run said about the directory: its start and set-asides."""
    lines = [
        re.sub(r" \(/[^)]*\)", "", line)[:240]
        for line in out.splitlines()
        if line.startswith(("Resuming from", "Skipping checkpoint", "soak child: SIGKILL"))
        or "NoUsableCheckpointError" in line
    ]
    start = re.search(r"Training from step (\d+)", out)
    return "; ".join(lines) + (f" [trained from step {start.group(1)}]" if start else "")


def soak(args) -> int:
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="dew-kill-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus(work / "corpus.txt")
    rng = random.Random(args.seed)
    reference, wall = run_child(work, work / "reference", work / "reference.npz", None, 600)
    if reference.returncode != 0:
        print(reference.stdout[-3000:], reference.stderr[-3000:])
        return 1
    print(f"reference run: {wall:.1f} s", flush=True)
    events, kills, sequences, exact = [], 0, 0, 0
    while kills < args.kills:
        sequences += 1
        directory = work / f"run{sequences:03d}"
        shutil.rmtree(directory, ignore_errors=True)
        planned = min(args.per_directory, args.kills - kills)
        landed = 0
        for _ in range(planned):
            kill = draw_kill(rng, wall)
            done, seconds = run_child(work, directory, work / "never.npz", kill, 600)
            killed = done.returncode == -signal.SIGKILL
            landed += killed
            events.append(
                {
                    "sequence": sequences,
                    "kill": kill,
                    "killed": killed,
                    "returncode": done.returncode,
                    "seconds": round(seconds, 1),
                    "said": summary_of(done.stdout + done.stderr),
                }
            )
            print(
                f"  run {sequences} kill {kill}: "
                f"{'killed' if killed else f'exit {done.returncode}'} after {seconds:.1f} s; "
                f"{events[-1]['said']}",
                flush=True,
            )
            if done.returncode not in (0, -signal.SIGKILL):
                print(done.stdout[-2000:], done.stderr[-3000:])
            if not killed:
                break
        out = work / f"final{sequences:03d}.npz"
        done, seconds = run_child(work, directory, out, None, 600)
        differ = same(out, work / "reference.npz") if done.returncode == 0 else ["(run failed)"]
        ok = not differ
        kills += landed
        exact += ok and landed > 0
        events.append(
            {
                "sequence": sequences,
                "final": True,
                "returncode": done.returncode,
                "exact": ok,
                "differ": differ[:10],
                "said": summary_of(done.stdout + done.stderr),
            }
        )
        print(
            f"run {sequences}: {landed} kill(s), final run "
            f"{'EXACT' if ok else 'DIFFERS: ' + ', '.join(differ[:5])}; {events[-1]['said']}",
            flush=True,
        )
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-3000:])
        if not ok:
            break
    failed = [e for e in events if e.get("final") and not e["exact"]]
    by_kind = {
        k: sum(e.get("killed", False) for e in events if e.get("kill", "").startswith(k))
        for k in KINDS
    }
    kinds = ", ".join(f"{k} {n}" for k, n in by_kind.items())
    verdict = "all exact" if not failed else f"{len(failed)} sequence(s) differ"
    print(f"{kills} kills on {sequences} directories ({kinds}): {verdict}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(events, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs that land, in all")
    parser.add_argument(
        "--per-directory", type=int, default=3, help="kills in a row on one directory"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--json", default=None, help="write every event to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--kill", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if args.kills < 1 or args.per_directory < 1:
        parser.error(f"--kills {args.kills} and --per-directory {args.per_directory} must be >= 1")
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
