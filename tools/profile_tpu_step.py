"""Where a training step's time goes on an accelerator: `jax.profiler` traces of Dew's
GPT-2 (tools/bench_tpu.py's network, seq 1024, batch 8) in the plain hand-written
jitted step and through `Trainer.fit`, summed per operation from the trace.

    python tools/profile_tpu_step.py hand_loop fit_loop hand_scan fit_scan fit_straight norms

Each argument is a run: ``hand_*`` the model in the plain loop's step, ``fit_*`` the
same model through ``Trainer.fit``; the stack ``loop`` (``use_scan=False``), ``scan``
(``unroll_layers=False``: one compiled loop, the default; ``scanauto``: the same with
the weights and optimizer state in the layouts XLA picks), ``straight`` (the scanned
parameters run layer after layer), ``unrolled`` (``nn.scan`` unrolled ``num_layers``
times), ``split`` (``hand_split``: the loop of blocks on stacked parameters, sliced
outside the gradient, see :func:`hand`); a ``hand_*`` run takes a guard suffix
(``hand_loop_cond``, see :func:`hand`); a run may name a remat policy after ``@``
(``hand_scan@minimal_with_context``); ``norms`` times ways of taking the global norm of
the parameter tree; a ``hand_*`` run may name compiler options after ``+``
(``hand_scan@minimal+vmem``, :data:`OPTIONS`). Prints, per run, the step time, the
device's idle time between steps and the operations that take the most time per step;
traces and each step's compiled HLO go to ``$OUT`` (default /tmp/out). ``TINY=1`` runs a
tiny model (a CPU check of the script).
docs/performance.md, "On a TPU v5e chip"."""

import itertools
import json
import os
import shutil
import sys
import time
from collections import Counter

import _trace  # tools/, this script's directory
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew import Dataset, Trainer, models
from dew.objectives.language.lm import LMObjective

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
TINY = os.environ.get("TINY") == "1"
S = dict(vocab_size=32000, emb_features=1024, num_layers=12, num_heads=16, mlp_features=4096,
         max_seq_len=1024, norm="layer", mlp_activation="gelu", position_embedding="learned",
         use_bias=True, dtype=jnp.bfloat16)  # fmt: skip
B, T = 8, 1024
if TINY:
    S.update(vocab_size=256, emb_features=64, num_layers=2, num_heads=4, mlp_features=128,
             max_seq_len=64)  # fmt: skip
    B, T = 2, 64
rng = np.random.default_rng(0)
toks = [rng.integers(0, S["vocab_size"], (B, T + 1)).astype(np.int32) for _ in range(4)]


def params_of(model):
    p = model.init(jax.random.key(0), jnp.asarray(toks[0][:1, :-1]))["params"]
    return jax.tree.map(lambda a: getattr(a, "value", a), p, is_leaf=lambda a: hasattr(a, "value"))


def stacked(params):
    """A loop of blocks' ``layer_{i}`` parameters as a scanned stack stores them:
    ``layers`` with a leading ``[num_layers]`` axis."""
    names = sorted((k for k in params if k.startswith("layer_")), key=lambda k: int(k[6:]))
    rest = {k: v for k, v in params.items() if k not in names}
    return {**rest, "layers": jax.tree.map(lambda *a: jnp.stack(a), *[params[k] for k in names])}


def unstacked(params):
    """:func:`stacked`'s inverse: ``layers[i]`` as ``layer_{i}``."""
    layers = params["layers"]
    count = jax.tree.leaves(layers)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    split = {f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], layers) for i in range(count)}
    return {**rest, **split}


# Compiler options a run may name after ``+`` (``hand_scan@minimal+vmem``), passed to
# the step's compile: what MaxText and AXLearn set on TPUs (AXLearn's v6e defaults),
# to see whether the scanned stack's separate elementwise fusions are the compiler's
# limits rather than the program's.
OPTIONS = {
    "vmem": dict(xla_tpu_scoped_vmem_limit_kib=98304),
    "sched": dict(xla_tpu_enable_all_experimental_scheduler_features="true",
                  xla_tpu_aggressive_opt_barrier_removal="ENABLED"),
    "nolhs": dict(xla_tpu_enable_latency_hiding_scheduler="false"),
}  # fmt: skip
OPTIONS["both"] = {**OPTIONS["vmem"], **OPTIONS["sched"]}


def hand(name, guard="none", split=False, auto_layout=False, options=None, **kw):
    """guard: how the update is kept from non-finite values: ``none`` (the plain
    loop), ``cond`` (``fit``'s: the global gradient norm's finiteness, the update
    under ``lax.cond``), ``select`` (the same predicate, a select per leaf), ``loss``
    (the loss's finiteness alone, a select per leaf fused into the update; the
    gradient norm still computed), ``loss_nonorm`` (the same without the norm);
    ``select_unorm`` (``select`` and the updates' norm, as ``fit`` logs it: under
    ``lax.cond`` on a traced flag, the updates computed again inside the branch from
    the gradients, the old optimizer state and the old weights: unless the selects
    are ordered after it, a select that writes a weight in place waits for the
    branch or copies the weight), ``select_unorm_updates`` (the branch's operand the
    updates tree, as ``fit`` had it until 2026-12-07: a buffer written every step)
    and ``select_unorm_fused`` (the same norm taken every step, free to fuse into the
    update); ``select_unorm_after`` (``select_unorm`` with every select ordered after the
    norm's branch, as ``fit`` since 2026-12-07: unordered, the loop of blocks copied every
    weight and moment the branch reads, 600 copies on a TPU v5e); ``select_ordered``
    (``select`` with the optimizer state's selects ordered after the weights'
    (``dew.train.step.after``): without the order XLA copies every
    state leaf the weights' fusions read, on the CPU as in ``tools/bench_ppo.py
    --hlo``; with it the copies go, and the chip says what that is worth).

    split: the loop of blocks' model on parameters stored stacked, as a scanned
    stack's checkpoint holds them: the step slices ``layers[i]`` outside the
    gradient, differentiates the ``layer_{i}`` tree and stacks the gradients for
    the update (a straight program whose gradient has no slices to transpose).

    auto_layout: the weights and the optimizer state in the layouts XLA picks for
    the step (``jax.experimental.layout.Layout.AUTO``, kept from step to step), not
    the default row-major ones: whether a scanned stack's time in layout copies is
    the stacked parameters' layout."""
    from dew.train.step import after, tree_norm, update_norm_if

    model = models.build("causal_transformer", **S, **kw)
    params = params_of(model)
    if split:
        params = stacked(params)
    opt = optax.adamw(3e-4)
    ost = opt.init(params)

    def loss_fn(p, t):
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    def step(p, o, t, logged):
        if split:
            loss, g = jax.value_and_grad(loss_fn)(unstacked(p), t)
            g = stacked(g)
        else:
            loss, g = jax.value_and_grad(loss_fn)(p, t)
        if guard == "none":
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o, loss
        norm = tree_norm(g, fused=True) if guard != "loss_nonorm" else jnp.zeros(())
        ok = jnp.isfinite(loss) & (jnp.isfinite(norm) if guard.startswith(("cond", "select"))
                                   else True)  # fmt: skip

        def apply(po):  # -> (params, opt state), the updates' norm
            u, o2 = opt.update(g, po[1], po[0])
            unorm = jnp.zeros(())
            if guard.startswith("select_unorm"):
                again = lambda: opt.update(g, po[1], po[0])[0]  # noqa: E731 (as fit's)
                if guard.endswith("fused"):
                    unorm = tree_norm(u) * logged
                else:  # the branch's operand: the updates again, or the updates tree
                    unorm = update_norm_if(logged, u if guard.endswith("updates") else again)
            return (optax.apply_updates(po[0], u), o2), unorm

        if guard == "cond":
            p, o = jax.lax.cond(ok, lambda po: apply(po)[0], lambda po: po, (p, o))
            unorm = jnp.zeros(())
        elif guard == "select_ordered":
            (new_p, new_o), unorm = apply((p, o))
            p = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_p, p)
            o = jax.tree.map(lambda a, b: jnp.where(after(ok, p), a, b), new_o, o)
        else:  # select_unorm_after: the selects ordered after the norm's branch (fit's)
            new, unorm = apply((p, o))
            if guard.endswith("after"):
                ok = after(ok, unorm)
            p, o = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, (p, o))
        return p, o, loss + 0 * norm + 0 * jnp.where(ok, unorm, 0.0)

    t0 = time.time()
    flag = jnp.asarray(False)  # fit's is_logged: traced, False on the steps timed here
    shardings = {}
    if auto_layout:
        from jax.experimental.layout import Format, Layout

        auto = Format(Layout.AUTO)
        shardings = dict(in_shardings=(auto, auto, None, None), out_shardings=(auto, auto, None))
    jitted = jax.jit(step, donate_argnums=(0, 1), **shardings)
    c = jitted.lower(params, ost, toks[0], flag).compile(compiler_options=options)
    ct = time.time() - t0
    if auto_layout:  # the state moved into the step's layouts once, as a trainer would
        (p_formats, o_formats, *_), _ = c.input_formats
        params, ost = jax.device_put(params, p_formats), jax.device_put(ost, o_formats)
        leaves = jax.tree.leaves(p_formats)
        kinds = Counter(str(f.layout) for f in leaves if len(f.layout.major_to_minor) > 2)
        print(f"{name}: the stacked weights' layouts: {kinds.most_common(6)}", flush=True)
    with open(f"{OUT}/{name}.hlo.txt", "w") as f:
        f.write(c.as_text())
    m = c.memory_analysis()
    batches = [jnp.asarray(x) for x in toks]
    p, o, loss = c(params, ost, batches[0], flag)
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for i in range(10):
        p, o, loss = c(p, o, batches[i % 4], flag)
    jax.block_until_ready(loss)
    dt = (time.perf_counter() - t0) / 10
    print(json.dumps(dict(name=name, step_ms=dt * 1e3, temp_gib=m.temp_size_in_bytes / 2**30,
                          compile_s=ct)), flush=True)  # fmt: skip
    d = f"{OUT}/trace_{name}"
    shutil.rmtree(d, ignore_errors=True)  # a trace of an earlier run would be read
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    for i in range(5):
        p, o, loss = c(p, o, batches[i % 4], flag)
    jax.block_until_ready((p, loss))
    jax.profiler.stop_trace()
    _trace.summarize(d, name, 5)
    del p, o


def fit(name, **kw):
    model = models.build("causal_transformer", **S, **kw)
    objective = LMObjective(model, seq_len=T)
    data = Dataset(train=lambda p: ({"text": x} for x in itertools.cycle(toks)), val=None,
                   records=4 * B, batch=B)  # fmt: skip
    trainer = Trainer(objective, optax.adamw(3e-4), key=jax.random.key(0), progress=False)
    d = f"{OUT}/trace_{name}"
    shutil.rmtree(d, ignore_errors=True)
    marks = {}

    def hook(info):
        if info.step == 1:
            jax.block_until_ready(info.state.params)
            marks["t"] = time.perf_counter()
            marks["first"] = marks["t"] - marks["start"]
        if info.step == 11:
            jax.block_until_ready(info.state.params)
            marks["dt"] = (time.perf_counter() - marks["t"]) / 10
            jax.profiler.start_trace(d, create_perfetto_trace=True)
        if info.step == 16:
            jax.block_until_ready(info.state.params)
            jax.profiler.stop_trace()

    trainer.add_hook(hook, name="diag")
    marks["start"] = time.perf_counter()
    trainer.fit(data, steps=18, log_every=0)
    (compiled,) = trainer.programs.cache.update.values()
    with open(f"{OUT}/{name}.hlo.txt", "w") as f:  # beside the hand steps' programs
        f.write(compiled.program.as_text())
    temp = compiled.program.memory_analysis().temp_size_in_bytes / 2**30
    print(json.dumps(dict(name=name, step_ms=marks["dt"] * 1e3, first_step_s=marks["first"],
                          temp_gib=temp)), flush=True)  # fmt: skip
    _trace.summarize(d, name, 5)


def norms():
    from dew.train.step import tree_norm

    model = models.build("causal_transformer", **S)
    g = params_of(model)
    ways = {
        "tree_norm": lambda t: tree_norm(t),
        "vdot": lambda t: jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(t))),
        "optax": lambda t: optax.tree.norm(t),
        "isfinite_all": lambda t: jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)])
        ),
        "max_abs": lambda t: jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(t)])),
    }
    for name, f in ways.items():
        c = jax.jit(f).lower(g).compile()
        jax.block_until_ready(c(g))
        t0 = time.perf_counter()
        for _ in range(20):
            r = c(g)
        jax.block_until_ready(r)
        print(f"norm {name}: {(time.perf_counter() - t0) / 20 * 1e3:.3f} ms", flush=True)


which = sys.argv[1:] or ["hand_loop", "fit_loop", "hand_scan"]
for w in which:
    if w == "norms":
        norms()
        continue
    w, _, option = w.partition("+")
    w, _, policy = w.partition("@")
    kind, stack, *guard = w.split("_", 2)
    kw = dict(use_scan=stack not in ("loop", "split"))
    if stack == "split":
        kw["split"] = True
    if stack == "scanauto":  # the scanned stack, its state in the layouts XLA picks
        kw["auto_layout"], stack = True, "scan"
    if policy:
        kw["remat_policy"] = policy
        w = f"{w}-{policy}"
    if guard:
        kw["guard"] = guard[0]
    if option:
        kw["options"] = OPTIONS[option]
        w = f"{w}+{option}"
    if stack in ("scan", "straight"):
        kw["unroll_layers"] = stack == "straight"
    if stack == "unrolled":  # nn.scan unrolled num_layers times (no option names it)
        import dataclasses

        from dew.nn.backbones._options import StackOptions

        StackOptions.built_layer_stack = getattr(
            StackOptions, "built_layer_stack", StackOptions.layer_stack
        )
        StackOptions.layer_stack = lambda self: dataclasses.replace(
            StackOptions.built_layer_stack(self), unroll=self.num_layers, straight=False
        )
    try:
        (hand if kind == "hand" else fit)(w, **kw)
    except Exception as e:  # noqa: BLE001
        print(w, "ERROR", repr(e)[-600:], flush=True)
