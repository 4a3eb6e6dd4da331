"""Document-packed windows on the chip: ``TokenWindows(documents="pack")`` windows through
a ``TINY_LM`` whose attention is chosen by backend (splash on a TPU, with the windows'
segment ids) and through the same model with the XLA kernel, against each document
run alone; float32 with matmuls at 'highest' precision. Prints the largest absolute
difference of the logits on the documents' positions.

    python tools/check_tpu_packed_documents.py [--seq-len 256]

Needs no Grain (the windows are read from the reader's rows); the same identity runs
in CI on the CPU (tests/test_packed_documents.py).
"""

import argparse
import json
import os
import tempfile

import flax.linen as nn
import jax
import numpy as np

from dew.data import TokenWindows
from dew.nn import CausalTransformer
from dew.nn.testing import TINY_LM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--documents", type=int, default=60)
    a = p.parse_args()
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)
    docs = [
        letters[rng.integers(0, 27, n)].tobytes().decode()
        for n in rng.integers(3, a.seq_len - 1, a.documents)
    ]
    with tempfile.TemporaryDirectory() as folder:
        corpus = os.path.join(folder, "docs.jsonl")
        with open(corpus, "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        reader = TokenWindows(
            corpus,
            seq_len=a.seq_len,
            documents="pack",
            val_fraction=0,
            cache_dir=os.path.join(folder, "cache"),
        )
        rows, _ = reader.splits()
        windows = rows.read_batch(np.arange(len(rows)))
    length = a.seq_len
    inputs = {key: windows[key][:, :length] for key in ("text", "segment_ids", "positions")}
    config = {**TINY_LM, "vocab_size": 264, "max_seq_len": length}
    with jax.default_matmul_precision("highest"):
        model = CausalTransformer(**config)
        variables = nn.unbox(model.init(jax.random.key(0), inputs["text"][:1]))
        packed = {
            kernel: np.asarray(
                jax.jit(CausalTransformer(**config, attention_kernel=kernel).apply)(
                    variables,
                    inputs["text"],
                    segment_ids=inputs["segment_ids"],
                    positions=inputs["positions"],
                )
            )
            for kernel in ("auto", "xla")
        }
        alone_rows, places = [], []
        for r, segments in enumerate(inputs["segment_ids"]):
            for segment in range(1, segments.max() + 1):
                columns = np.flatnonzero(segments == segment)
                row = np.zeros(length, np.int32)
                row[: len(columns)] = inputs["text"][r, columns]
                alone_rows.append(row)
                places.append((r, columns))
        alone = np.asarray(jax.jit(model.apply)(variables, np.stack(alone_rows)))
    for kernel, logits in packed.items():
        worst = max(
            float(np.abs(logits[r, columns] - one[: len(columns)]).max())
            for (r, columns), one in zip(places, alone, strict=True)
        )
        result = dict(
            kernel=kernel, windows=len(inputs["text"]), documents=len(places), worst=worst
        )
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
