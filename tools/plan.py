"""Size a training run on hardware you do not have: per-device memory and step
FLOPs of a registered model on a mesh, from compilation alone
(:func:`dew.train.plan`; nothing is allocated or run).

    python tools/plan.py --devices 64 --mesh data=4,fsdp=8,tensor=2 \\
        --batch 256 --seq-len 2048 --optimizer adamw \\
        --config vocab_size=32000,emb_features=2048,num_layers=18,num_heads=16,\\
mlp_features=5632,max_seq_len=2048,dtype=bfloat16,use_remat=true

--devices N emulates N CPU devices (XLA_FLAGS, set before JAX starts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_pairs(text: str) -> dict:
    """``a=1,b=true,c=bfloat16`` -> ``{"a": 1, "b": True, "c": "bfloat16"}``."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected name=value, got {item!r} in {text!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices",
        type=int,
        default=0,
        help="emulate this many CPU devices (0 = the devices JAX finds)",
    )
    parser.add_argument("--mesh", default="", help="MeshSpec axes, e.g. data=4,fsdp=8,tensor=2")
    parser.add_argument("--model", default="causal_transformer", help="registered model name")
    parser.add_argument("--config", required=True, help="model options, name=value,...")
    parser.add_argument("--batch", type=int, required=True, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens a sequence")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    parser.add_argument("--accumulate", type=int, default=1, help="microbatches per update")
    args = parser.parse_args(argv)

    if args.devices:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = " ".join(
            [
                f
                for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ]
            + [f"--xla_force_host_platform_device_count={args.devices}"]
        )
    import jax.numpy as jnp
    import optax

    from dew.nn import models
    from dew.objectives.language.lm import LMObjective
    from dew.train import MeshSpec, plan

    config = parse_pairs(args.config)
    for key in ("dtype", "param_dtype"):
        if key in config:
            config[key] = jnp.dtype(config[key])
    model = models.build(args.model, **config)
    optimizer = {"adamw": optax.adamw, "adam": optax.adam, "sgd": optax.sgd}[args.optimizer](1e-4)
    report = plan(
        LMObjective(model=model, seq_len=args.seq_len),
        optimizer,
        mesh=MeshSpec(**parse_pairs(args.mesh)),
        batch={"text": ((args.batch, args.seq_len + 1), jnp.int32)},
        accumulate=args.accumulate,
    )
    print(report)


if __name__ == "__main__":
    main(sys.argv[1:])
