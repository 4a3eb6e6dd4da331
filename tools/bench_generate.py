"""Dew's ``generate`` against transformers' ``generate`` (torch, CPU), a
hand-written cached JAX decode loop, and an uncached one, side by side.

All sides decode the same tiny Llama weights greedily (a transformers
``LlamaForCausalLM`` when transformers is importable, read by
``Pretrained.load``; random Dew weights otherwise), from the same batch of
prompts, for exactly ``--new-tokens`` tokens (no end id), in one process under
one allocator setting. Each number is the median of ``--repeats`` timed runs
after one warm-up run (compilation excluded); the machine is shared, so
each side reports its best of ``--repeats`` runs (as ``timeit`` does) and
the median beside it. Two sizes by default: ``tiny`` (the seed's width: emb
64, 2 layers) and ``small`` (emb 256, 4 layers).

The hand-written loop is a plain prefill + ``fori_loop`` of cached steps
over the same module, in two variants: over the model as it is (its layers
scanned, Dew's default) and over the same model with its layers unrolled,
which is what Dew's ``generate`` decodes with.

    python tools/bench_generate.py                       # Dew, hand-written, uncached
    /tmp/parity/bin/python tools/bench_generate.py       # + transformers, where installed
    python tools/bench_generate.py --new-tokens 128 --batch 8 --repeats 3
    python tools/bench_generate.py --hlo     # + each loop body's HLO instruction count
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import statistics
import tempfile
import time

# Both sides run under Dew's allocator setting (dew.nn.allocator; DEW_ALLOCATOR=system opts out),
# applied before anything allocates.
from dew.nn.allocator import configure_allocator  # noqa: E402

configure_allocator()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dew.nn import CausalTransformer  # noqa: E402
from dew.sampling import Pretrained, Sampling, decode, generate, pad_prompts  # noqa: E402
from dew.sampling.causal.prompts import PROMPT_BUCKET  # noqa: E402
from dew.sampling.generate import unrolled  # noqa: E402

SIZES = {
    "tiny": dict(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    "small": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
    ),
}


def llama_weights(directory: str, size: str) -> tuple[Pretrained, object | None]:
    """``(Pretrained, the transformers model or None)`` on the same weights."""
    config = SIZES[size]
    if importlib.util.find_spec("transformers") is None:
        model = CausalTransformer(
            vocab_size=config["vocab_size"],
            emb_features=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            mlp_features=config["intermediate_size"],
            max_seq_len=config["max_position_embeddings"],
        )
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        return Pretrained(model=model, params=params), None
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        **config, bos_token_id=None, eos_token_id=None, pad_token_id=0, attn_implementation="sdpa"
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # weights large enough that greedy decoding does not loop on one id
        for p in hf.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.5 * config["hidden_size"] ** -0.5)
    hf.save_pretrained(directory)
    return Pretrained.load(directory), hf


def hand_written(model, params, tokens, new_tokens):
    """A plain cached greedy decode: prefill, then one fori_loop; equal-length prompts."""
    run = hand_written_program(model, new_tokens)
    return lambda: np.asarray(run(params, tokens))


def hand_written_program(model, new_tokens):
    """The jitted ``run(params, tokens)`` of :func:`hand_written`."""

    @jax.jit
    def run(params, tokens):
        batch, length = tokens.shape
        cache_shapes = jax.eval_shape(
            lambda: model.apply(
                {"params": params},
                jnp.zeros((batch, length + new_tokens), jnp.int32),
                decode=True,
                mutable=["cache"],
            )[1]["cache"]
        )
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)
        logits, v = model.apply(
            {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
        )
        token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        out = jnp.zeros((batch, new_tokens), jnp.int32).at[:, 0].set(token)

        def body(i, carry):
            cache, token, out = carry
            position = jnp.full((batch, 1), length - 1 + i, jnp.int32)
            logits, v = model.apply(
                {"params": params, "cache": cache},
                token[:, None],
                positions=position,
                decode=True,
                mutable=["cache"],
            )
            token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
            return v["cache"], token, out.at[:, i].set(token)

        return jax.lax.fori_loop(1, new_tokens, body, (v["cache"], token, out))[2]

    return run


def loop_body_size(hlo: str) -> tuple[int, int]:
    """``(instructions, fusions)`` of the largest while-loop body in compiled HLO
    text: the per-token decode step (the layers unrolled, so no loop nests in it)."""
    bodies, name, count, fusions = {}, None, 0, 0
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            name, count, fusions = line.split()[0].lstrip("%"), 0, 0
        elif line.startswith("}") and name:
            bodies[name], name = (count, fusions), None
        elif name and line.strip():
            count += 1
            fusions += " fusion(" in line
    called = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    return max((bodies[b] for b in called if b in bodies), default=(0, 0))


def print_loop_bodies(model, params, tokens, new_tokens, greedy) -> None:
    """Each side's per-token loop body, as compiled for this backend."""
    prompt_tokens, mask = pad_prompts(tokens.tolist(), 0, multiple=PROMPT_BUCKET)
    dew = jax.jit(
        functools.partial(decode, model, max_new_tokens=new_tokens, sampling=greedy)
    ).lower(params, prompt_tokens, mask, key=jax.random.key(0))
    flat_model, flat_params = unrolled(model, params)
    sides = {
        "dew generate": dew,
        "hand-written, layers unrolled": hand_written_program(flat_model, new_tokens).lower(
            flat_params, tokens
        ),
    }
    for name, lowered in sides.items():
        instructions, fusions = loop_body_size(lowered.compile().as_text())
        print(f"  {name:30s} loop body: {instructions} HLO instructions, {fusions} fusions")


def uncached(model, params, tokens, new_tokens):
    """Greedy decode that recomputes the whole sequence at every step (no cache)."""

    @jax.jit
    def run(params, tokens):
        batch, length = tokens.shape
        buffer = jnp.zeros((batch, length + new_tokens), jnp.int32).at[:, :length].set(tokens)

        def body(i, buffer):  # causal: what lies right of position length+i-1 does not matter
            logits = model.apply({"params": params}, buffer)
            token = jnp.argmax(logits[:, length + i - 1], -1).astype(jnp.int32)
            return buffer.at[:, length + i].set(token)

        return jax.lax.fori_loop(0, new_tokens, body, buffer)[:, length:]

    return lambda: np.asarray(run(params, tokens))


def transformers_side(hf, tokens, new_tokens, threads):
    import torch

    ids = torch.as_tensor(tokens, dtype=torch.long)

    def run():
        # torch's OpenMP threads stall when another process holds a core, so
        # transformers runs with 1 thread and with all of them; its best counts.
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=0,
                )
        finally:
            torch.set_num_threads(previous)
        return out[:, ids.shape[1] :].numpy()

    return run


def timed(sides, repeats):
    """Per side ``(best seconds, median seconds, output)``. One warm-up call
    each (compiles), then ``repeats`` rounds that run every side in turn, so a
    burst of load from other processes hits all sides alike."""
    outputs = {name: fn() for name, fn in sides.items()}
    times = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(t), statistics.median(t), outputs[name]) for name, t in times.items()}


def bench(size: str, args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        pretrained, hf = llama_weights(directory, size)
    model, params = pretrained.model, pretrained.params
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, model.vocab_size, (args.batch, args.prompt_tokens)).astype(np.int32)
    prompts = tokens.tolist()
    greedy = Sampling(temperature=0)
    dew = functools.partial(
        generate, model, params, prompts, args.new_tokens, jax.random.key(0), sampling=greedy
    )
    flat_model, flat_params = unrolled(model, params)
    sides = {
        "dew generate": lambda: np.asarray([row[args.prompt_tokens :] for row in dew().tokens]),
        "hand-written, layers unrolled": hand_written(
            flat_model, flat_params, jnp.asarray(tokens), args.new_tokens
        ),
        "hand-written, layers scanned": hand_written(
            model, params, jnp.asarray(tokens), args.new_tokens
        ),
        "uncached jax": uncached(model, params, jnp.asarray(tokens), args.new_tokens),
    }
    if hf is not None:
        import torch

        for threads in sorted({1, torch.get_num_threads()}):
            sides[f"transformers, {threads} thread(s)"] = transformers_side(
                hf, tokens, args.new_tokens, threads
            )
    print(
        f"\n{size}: llama emb {model.emb_features}, {model.num_layers} layers, "
        f"{model.num_heads} heads ({model.kv_heads} kv), mlp {model.mlp_features}, vocab "
        f"{model.vocab_size}; batch {args.batch}, prompt {args.prompt_tokens}, "
        f"{args.new_tokens} new tokens, greedy; best (median) of {args.repeats}"
    )
    if args.hlo:
        print_loop_bodies(model, params, jnp.asarray(tokens), args.new_tokens, greedy)
    rates = {}
    for name, (seconds, median, output) in timed(sides, args.repeats).items():
        rates[name] = args.batch * args.new_tokens / seconds
        if name == "dew generate":
            reference = output
        same = float(np.mean(output == reference))
        print(
            f"  {name:30s} {rates[name]:9.0f} new tokens/s  ({seconds * 1000:7.1f} ms, median "
            f"{median * 1000:7.1f} ms; tokens equal to Dew's: {same:.0%})"
        )
    hf_rates = [r for name, r in rates.items() if name.startswith("transformers")]
    if hf_rates:
        rates["transformers generate (best)"] = max(hf_rates)
    for name, goal in (
        ("transformers generate (best)", 2.0),
        ("hand-written, layers unrolled", 1.0),
        ("hand-written, layers scanned", 1.0),
        ("uncached jax", None),
    ):
        if name in rates:
            target = f"   (goal >= {goal})" if goal else ""
            print(f"  Dew / {name}: {rates['dew generate'] / rates[name]:.2f}x{target}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,small", help="comma-separated: tiny, small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="also count the HLO instructions of Dew's and the hand-written loop's per-token body",
    )
    args = parser.parse_args()
    line = f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}"
    if importlib.util.find_spec("transformers") is not None:
        import torch
        import transformers

        line += (
            f"; transformers {transformers.__version__}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)"
        )
    print(line)
    for size in args.sizes.split(","):
        bench(size.strip(), args)


if __name__ == "__main__":
    main()
