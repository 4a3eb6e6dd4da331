"""Data readers against a raw memory-mapped numpy reader, on one core, in one run.

    .venv/bin/python tools/bench_data.py            # about a minute on a quiet core
    .venv/bin/python tools/bench_data.py --quick    # smaller, a few seconds
    .venv/bin/python tools/bench_data.py --shares-only   # mixture and packing vs the step

Measures, with the process pinned to one CPU and Grain reading in the
caller's thread (``read_threads=0``):

- TokenWindows tokens/s (shuffled windows of ``seq_len + 1`` ids, batched)
  against a raw reader: the same token file memory-mapped with numpy, random
  windows gathered with one fancy index per batch.
- Host milliseconds per batch of a three-source ``Mixture`` (70/20/10, of plain and
  of packed windows) and of document-aware packing (``TokenWindows(documents="pack")``,
  documents of 5 to 400 words, longer ones split), next to plain TokenWindows on the
  same documents, at the seed LM's size (batch 8 x 65) and the medium LM's (16 x
  257), each as a share of the training step of that size, timed in the same run on
  all cores (``LMObjective``, adamw, batches already in memory).
- HFImages images/s (JPEG decode, resize, centre crop, from a ``datasets``
  table) against a raw reader of already decoded images (a memory-mapped
  uint8 array) and against a plain decode loop (PIL + the same resize, no
  Grain, no ``datasets``), which separates the decode cost from the pipeline's.
- Unless ``--no-train``: a quickstart-size training run fed by TokenWindows
  (all cores), and the share of its wall time spent waiting for data
  (the trainer's goodput breakdown).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time

import numpy as np


def pin_to_one_core() -> set[int] | None:
    """Pin this thread (and threads it starts later) to one CPU; the old set, to restore."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    return allowed


def rate(count: float, seconds: float) -> float:
    return count / max(seconds, 1e-9)


def best_times(fns: dict, repeats: int = 3) -> dict[str, float]:
    """The best of ``repeats`` runs of each function, in seconds; the functions take
    turns (A, B, A, B, ...) so a slower moment of a shared machine hits them alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_tokens(workdir: str, *, megabytes: int, seq_len: int, batch: int, batches: int):
    from dew.data import Partition, TokenWindows

    words = np.asarray("dew trains jax models on grain with windows of tokens".split())
    rng = np.random.default_rng(0)
    corpus = os.path.join(workdir, "corpus.txt")
    with open(corpus, "w") as f:
        for _ in range(megabytes):
            f.write(" ".join(rng.choice(words, 180_000)) + "\n")
    reader = TokenWindows(
        corpus,
        seq_len=seq_len,
        cache_dir=os.path.join(workdir, "cache"),
        val_fraction=0,
        read_threads=0,
        prefetch=0,
    )
    start = time.perf_counter()
    ids = reader.tokens()
    tokenize_s = time.perf_counter() - start
    data = reader.load(batch=batch)

    def grain_reader():
        iterator = data.train(Partition())
        for _ in range(batches):
            next(iterator)

    # The raw reader: the same memory-mapped file (the cache's one shard), one
    # shuffled permutation of the windows, each batch gathered with one fancy index.
    (path,) = ids.paths
    raw = np.memmap(path, dtype=ids.dtype, mode="r", shape=ids.shape)
    windows = (raw.shape[0] - 1) // seq_len
    offsets = np.arange(seq_len + 1)

    def raw_reader():
        order = np.random.default_rng(0).permutation(windows)
        for b in range(batches):
            starts = order[(np.arange(batch) + b * batch) % windows] * seq_len
            np.asarray(raw[starts[:, None] + offsets], np.int32)

    tokens = batches * batch * (seq_len + 1)
    seconds = best_times({"grain": grain_reader, "raw": raw_reader})
    return {
        "corpus_tokens": int(ids.shape[0]),
        "tokenize_tokens_per_s": rate(ids.shape[0], tokenize_s),
        "token_windows_tokens_per_s": rate(tokens, seconds["grain"]),
        "raw_memmap_tokens_per_s": rate(tokens, seconds["raw"]),
    }


# emb, layers, heads, mlp, seq_len, batch: the seed run's LM (examples/quickstart.py) and
# the medium LM (as tools/bench_cpu_split.py's sizes)
SIZES = {"seed": (64, 2, 4, 256, 64, 8), "medium": (256, 4, 8, 1024, 256, 16)}
STEPS = {"seed": 60, "medium": 5}  # timed steps a fit: a second or more at each size


def bench_mixture_and_packing(
    workdir: str, *, documents: int, seq_len: int, batch: int, batches: int
):
    """Host ms per batch of plain TokenWindows, ``documents="pack"`` and a three-source
    Mixture (70/20/10) on documents of 5 to 400 words, in the caller's thread."""
    from dew.data import Mixture, Partition, TokenWindows

    words = np.asarray("dew trains jax models on grain with windows of tokens".split())
    rng = np.random.default_rng(1)
    corpus = os.path.join(workdir, f"documents-{documents}.jsonl")
    with open(corpus, "w") as f:
        for size in rng.integers(5, 400, documents):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size))}) + "\n")
    common = dict(
        seq_len=seq_len,
        cache_dir=os.path.join(workdir, "cache"),
        val_fraction=0,
        read_threads=0,
        prefetch=0,
    )
    stream = TokenWindows(corpus, **common)
    packed = TokenWindows(corpus, documents="pack", long_documents="split", **common)
    weights = {"web": 0.7, "code": 0.2, "books": 0.1}
    readers = {
        "token_windows": stream,
        "packed": packed,
        "mixture": Mixture(dict.fromkeys(weights, stream), weights, read_threads=0, prefetch=0),
        "mixture_packed": Mixture(
            dict.fromkeys(weights, packed), weights, read_threads=0, prefetch=0
        ),
    }
    loaded = {name: reader.load(batch=batch) for name, reader in readers.items()}

    def reading(data):
        def read():
            iterator = data.train(Partition())
            for _ in range(batches):
                next(iterator)

        return read

    seconds = best_times({name: reading(data) for name, data in loaded.items()})
    return {f"{name}_ms_per_batch": 1e3 * s / batches for name, s in seconds.items()}


def bench_step(size: str, steps: int) -> float:
    """Seconds per training step (``LMObjective``, adamw, all cores) of the LM of ``size``
    on batches already in memory: the step the data must keep up with."""
    import itertools
    import sys

    import jax
    import optax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _timing

    from dew import Dataset, Trainer, models
    from dew.objectives.language.lm import LMObjective

    emb, layers, heads, mlp, seq_len, batch = SIZES[size]
    model = models.build(
        "causal_transformer", vocab_size=264, emb_features=emb, num_layers=layers,
        num_heads=heads, mlp_features=mlp, max_seq_len=seq_len,
    )  # fmt: skip
    rows = np.random.default_rng(0).integers(0, 256, (4, batch, seq_len + 1)).astype(np.int32)
    data = Dataset(
        train=lambda p: ({"text": b} for b in itertools.cycle(rows)),
        val=None,
        records=4 * batch,
        batch=batch,
    )
    trainer = Trainer(
        LMObjective(model, seq_len=seq_len), optax.adamw(3e-3), key=jax.random.key(0),
        progress=False,
    )  # fmt: skip
    _timing.fit_seconds(trainer, data, 2)  # compiles
    return min(_timing.fit_seconds(trainer, data, steps + 1)[1] for _ in range(3))


def bench_images(
    workdir: str,
    *,
    count: int,
    source_size: tuple[int, int],
    image_size: int,
    batch: int,
    batches: int,
):
    import datasets
    from PIL import Image

    from dew.data import HFImages, Partition
    from dew.data.images import fit_image

    rng = np.random.default_rng(0)
    height, width = source_size
    y, x = np.mgrid[0:height, 0:width]
    encoded = []
    for i in range(count):
        base = np.stack([(x * (i % 7 + 1)) % 256, (y * 3 + i) % 256, (x + y) % 256], -1)
        noisy = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(noisy).save(out, format="JPEG", quality=90)
        encoded.append(out.getvalue())
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in encoded], "label": list(range(count))},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    data = HFImages(table, image_size=image_size, read_threads=0, prefetch=0).load(batch=batch)

    def grain_reader():
        iterator = data.train(Partition())
        for _ in range(batches):
            next(iterator)

    def decode_loop():
        order = np.random.default_rng(0).permutation(count)
        for b in range(batches):
            rows = order[(np.arange(batch) + b * batch) % count]
            np.stack([fit_image(Image.open(io.BytesIO(encoded[r])), image_size) for r in rows])

    decoded_file = os.path.join(workdir, "decoded.npy")
    decoded = np.lib.format.open_memmap(
        decoded_file, mode="w+", dtype=np.uint8, shape=(count, image_size, image_size, 3)
    )
    for i, blob in enumerate(encoded):
        decoded[i] = fit_image(Image.open(io.BytesIO(blob)), image_size)
    decoded.flush()
    raw = np.load(decoded_file, mmap_mode="r")

    def raw_reader():
        order = np.random.default_rng(0).permutation(count)
        for b in range(batches):
            np.asarray(raw[np.sort(order[(np.arange(batch) + b * batch) % count])])

    images = batches * batch
    seconds = best_times({"grain": grain_reader, "decode": decode_loop, "raw": raw_reader})
    return {
        "hf_images_per_s": rate(images, seconds["grain"]),
        "decode_loop_images_per_s": rate(images, seconds["decode"]),
        "raw_memmap_images_per_s": rate(images, seconds["raw"]),
    }


def bench_training(workdir: str, steps: int):
    """A quickstart-size run (examples/quickstart.py's model) fed by TokenWindows."""
    import jax
    import optax

    from dew import Trainer, models
    from dew.data import TokenWindows
    from dew.objectives.language.lm import LMObjective

    corpus = os.path.join(workdir, "small.txt")
    with open(corpus, "w") as f:
        f.write("dew trains jax models. " * 2000)
    data = TokenWindows(corpus, seq_len=64, cache_dir=os.path.join(workdir, "cache")).load(batch=8)
    model = models.build(
        "causal_transformer",
        vocab_size=264,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        mlp_features=256,
        max_seq_len=128,
    )
    run_dir = os.path.join(workdir, "run")
    Trainer(
        LMObjective(model=model, seq_len=64),
        optax.adamw(3e-3),
        key=jax.random.key(0),
        run_dir=run_dir,
        progress=False,
    ).fit(data, steps=steps, log_every=0)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    goodput = next(r for r in records if r.get("kind") == "goodput")
    return {
        "train_steps": steps,
        "train_wall_s": goodput["wall"],
        "train_steps_s": goodput["steps"],
        "train_data_s": goodput["data"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--no-train", action="store_true", help="skip the training run")
    parser.add_argument(
        "--shares-only",
        action="store_true",
        help="only the mixture and packing per batch against the step, at both sizes",
    )
    parser.add_argument("--json", help="also write the numbers to this file")
    args, _ = parser.parse_known_args()  # the nox bench session passes the same posargs to all
    quick = args.quick
    tokens = images = training = {}
    with tempfile.TemporaryDirectory() as workdir:
        allowed = pin_to_one_core()
        if not args.shares_only:
            windows = {"seq_len": 1024, "batch": 32, "batches": 20 if quick else 200}
            tokens = bench_tokens(workdir, megabytes=2 if quick else 16, **windows)
            images = bench_images(
                workdir,
                count=64 if quick else 512,
                source_size=(240, 320),
                image_size=64,
                batch=32,
                batches=4 if quick else 32,
            )
        mixing = {}
        for size, (*_, seq_len, batch) in SIZES.items():
            numbers = bench_mixture_and_packing(
                workdir,
                documents=300 if quick else 3000,
                seq_len=seq_len,
                batch=batch,
                batches=50 if quick else 400,
            )
            mixing.update({f"{size}_{key}": value for key, value in numbers.items()})
        if allowed is not None:
            os.sched_setaffinity(0, allowed)
        for size in SIZES:  # all cores, as a training process has them
            mixing[f"{size}_step_ms"] = 1e3 * bench_step(size, 3 if quick else STEPS[size])
        if not (args.no_train or args.shares_only):
            training = bench_training(workdir, 30 if quick else 100)
    results = {**tokens, **mixing, **images, **training}
    print(
        f"data on one core ({'pinned' if allowed is not None else 'not pinned'}), "
        f"read_threads=0, best of 3 alternating runs; steps on all cores, best of 3"
    )
    if tokens:
        print(
            f"  tokenize once (ByteTokenizer)   {tokens['tokenize_tokens_per_s'] / 1e6:9.1f} "
            f"M tokens/s ({tokens['corpus_tokens'] / 1e6:.1f} M tokens)"
        )
        print(
            f"  TokenWindows                    "
            f"{tokens['token_windows_tokens_per_s'] / 1e6:9.1f} M tokens/s"
        )
        print(
            f"  raw memmap numpy windows        {tokens['raw_memmap_tokens_per_s'] / 1e6:9.1f} "
            f"M tokens/s"
        )
        print(
            f"  ratio TokenWindows / raw        "
            f"{tokens['token_windows_tokens_per_s'] / tokens['raw_memmap_tokens_per_s']:9.2f}"
        )
    for size, (emb, layers, _, _, seq_len, batch) in SIZES.items():
        step = mixing[f"{size}_step_ms"]
        print(
            f"  {size} LM (emb {emb}, {layers} layers, batch {batch} x {seq_len + 1}): "
            f"step {step:.2f} ms"
        )
        for name, what in (
            ("token_windows", "TokenWindows, documents      "),
            ("packed", "documents='pack'             "),
            ("mixture", "Mixture of 3 (70/20/10)      "),
            ("mixture_packed", "Mixture of 3, packed         "),
        ):
            ms = mixing[f"{size}_{name}_ms_per_batch"]
            print(f"    {what} {ms:8.3f} ms a batch, {100 * ms / step:7.3g}% of the step")
    if images:
        print(f"  HFImages (JPEG 320x240 -> 64)   {images['hf_images_per_s']:9.0f} images/s")
        print(
            f"  plain PIL decode loop           {images['decode_loop_images_per_s']:9.0f} images/s"
        )
        print(
            f"  raw memmap numpy (pre-decoded)  {images['raw_memmap_images_per_s']:9.0f} images/s"
        )
        print(
            f"  ratio HFImages / decode loop    "
            f"{images['hf_images_per_s'] / images['decode_loop_images_per_s']:9.2f}"
        )
        print(
            f"  ratio HFImages / raw memmap     "
            f"{images['hf_images_per_s'] / images['raw_memmap_images_per_s']:9.4f}"
        )
    if training:
        share = training["train_data_s"] / training["train_wall_s"]
        print(
            f"quickstart-size training, {training['train_steps']} steps fed by TokenWindows: "
            f"data {training['train_data_s']:.3f} s of {training['train_wall_s']:.2f} s wall "
            f"({100 * share:.2f}%), steps {training['train_steps_s']:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
