"""Autoregressive vs masked diffusion (MDLM) vs block diffusion (BD3-LM) on a text file.

Three models of the same size are trained on the same byte windows of a local text
file (through ``TokenWindows``; by default this repository's own docs/*.md, joined)
for the same steps, then evaluated on the same held-out windows: the AR model's
perplexity, and the diffusion models' perplexity bounds (``exp(NELBO per token)``,
MDLM's unbiased estimate, with its standard error). Each diffusion model then samples
8 rows, scored by the AR model (generative perplexity) beside their unigram entropy.

    uv run --locked python examples/masked_diffusion.py [--text FILE] [--steps 400] [--blocks 4,16]

Options: ``--text`` a .txt file; ``--steps`` training steps per model; ``--seq-len``
ids per window (a multiple of every block size); ``--blocks`` BD3-LM block sizes;
``--batch`` rows per step; ``--eval-times`` stratified times per held-out row.
Prints one table row per model (docs/token-diffusion.md shows a run's table).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np
import optax

from dew.data import ByteTokenizer, TokenWindows
from dew.nn import CausalTransformer, Transformer
from dew.objectives.diffusion.block import BlockDiffusionObjective
from dew.objectives.diffusion.masked import MaskedDiffusionObjective
from dew.objectives.language.lm import LMObjective
from dew.sampling import MaskedSampler, sample_entropy
from dew.train import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = pathlib.Path("runs/masked_diffusion")


def corpus(path: str | None) -> pathlib.Path:
    if path is not None:
        return pathlib.Path(path)
    RUNS.mkdir(parents=True, exist_ok=True)
    out = RUNS / "docs.txt"
    out.write_text("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--blocks", default="4,16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-times", type=int, default=8)
    args = parser.parse_args()
    tokenizer = ByteTokenizer()
    length = args.seq_len  # ids per window: the AR model reads length - 1 and scores them
    windows = TokenWindows(
        str(corpus(args.text)), seq_len=length - 1, val_fraction=0.1, cache_dir=RUNS / "tokens"
    )
    data = windows.load(batch=args.batch)
    size = dict(emb_features=64, num_layers=2, num_heads=4, mlp_features=256)
    vocab = tokenizer.vocab_size  # 264, with the mask id 258
    denoiser = Transformer(
        vocab_size=vocab, max_seq_len=length, position_embedding="learned", **size
    )
    objectives = {
        "AR": LMObjective(model=CausalTransformer(vocab_size=vocab, max_seq_len=length, **size)),
        "MDLM": MaskedDiffusionObjective(
            model=denoiser, seq_len=length, eval_times=args.eval_times
        ),
    }
    for block in (int(b) for b in args.blocks.split(",") if b):
        objectives[f"BD3-LM {block}"] = BlockDiffusionObjective(
            model=denoiser,
            seq_len=length,
            block_size=block,
            eval_times=args.eval_times,
            clip_search=(),
        )
    states, rows = {}, []
    for name, objective in objectives.items():
        trainer = Trainer(objective, optax.adamw(1e-3), key=jax.random.key(0), progress=False)
        state = trainer.fit(data, steps=args.steps, log_every=max(1, args.steps // 4))
        states[name] = (trainer, state)
        result = trainer.evaluate(state, data)
        figure = result.get("perplexity", result.get("perplexity_bound"))
        # the bound's standard error over held-out rows, as a factor on the perplexity
        spread = float(np.exp(result["nelbo_stderr"])) if "nelbo_stderr" in result else None
        kind = "bound" if "perplexity_bound" in result else "exact"
        rows.append([name, figure, kind, spread])
    judge, judge_state = states["AR"]
    for row in rows[1:]:
        objective = objectives[row[0]]
        steps = objective.block_size if isinstance(objective, BlockDiffusionObjective) else length
        pipe = objective.inference_task(states[row[0]][1])
        pipe.sampler = MaskedSampler(num_steps=steps, first_hitting=True)
        ids = pipe.sample_ids(np.zeros((8, 0), np.int32), jax.random.key(1))
        ids = np.where(ids == objective.mask_token, tokenizer.end_id, ids)
        scored = judge.objective.evaluate(
            judge_state.variables(), {"text": ids.astype(np.int32)}, None
        )
        nll = float(scored["loss"].value)
        row += [float(np.exp(min(nll, 80.0))), float(sample_entropy(ids).mean())]
    print(
        "| model | held-out perplexity | kind (standard error, x/÷) | generative perplexity "
        "(AR judge) | entropy |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        kind = row[2] + (f" ({row[3]:.4f})" if row[3] is not None else "")
        extra = [f"{row[4]:.2f}", f"{row[5]:.2f}"] if len(row) > 4 else ["", ""]
        print(f"| {row[0]} | {row[1]:.2f} | {kind} | {extra[0]} | {extra[1]} |")
    print(f"trained {len(rows)} models for {args.steps} steps on {windows.paths}")


if __name__ == "__main__":
    main()
