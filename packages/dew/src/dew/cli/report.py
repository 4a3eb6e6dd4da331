"""``dew report RUN_DIR``: one self-contained HTML page (and the PNGs beside it)
of a run's curves, the goodput breakdown and the latest previews (images, and text
samples as written), drawn with matplotlib (the ``[report]`` extra: ``pip install
'dew-jax[report]'``, or ``uv sync --all-packages --extra report`` in a Dew checkout);
the images are embedded, so the page opens anywhere.

One panel per quantity of its own scale, training and evaluation on the same panel
(the evaluation dashed, with markers; the averaged weights' evaluation apart): the
losses; each of a family's headline metrics (reward, KL, accuracy, the bound of a
diffusion model, perplexity); every other metric; the learning rate; the norms; each
throughput. A panel whose values span more than a decade is drawn on a log scale.
Counts (tokens, pairs, FLOPs, ...) and panels of one constant value are not plotted:
their last values are a table."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re

__all__ = ["write_report", "panels"]

BOOKKEEPING = ("step", "kind", "time", "ema")
# counts and sizes: tabulated (their last value), never plotted beside metrics
COUNTS = ("tokens", "pairs", "rows", "examples", "masked", "step_flops", "group", "samples")
RATES = {
    "learning_rate": "learning rate",
    "lr": "learning rate",
    "tokens_per_second": "tokens per second",
    "rollout_tokens_per_second": "tokens per second",
    "examples_per_second": "examples per second",
    "step_seconds": "seconds",
    "prepare_seconds": "seconds",
    "mfu": "MFU",
}
# a family's headline metrics, a panel each: (panel, words that put a key in it)
HEADLINES = (
    ("reward", ("reward", "score", "margin")),
    ("KL", ("kl",)),
    ("accuracy", ("accuracy",)),
    ("perplexity", ("perplexity",)),
    ("bound", ("nelbo", "elbo", "bound", "vb", "bpd")),
)
LOG_SPAN = 10.0  # max / min above this: a log scale
SIZE = (5.8, 2.8)  # inches of a panel, at 100 dots an inch
# bounded quantities and rates (a first step's compilation is no decade of throughput):
# never on a log scale
LINEAR = ("reward", "accuracy", "fractions", "clip window", *RATES.values())


def _rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _words(key: str) -> list[str]:
    return re.split(r"[_/.]", key.lower())


def _is_count(key: str) -> bool:
    words = _words(key)
    if "nll" in words or "loss" in words:
        return False
    return key in COUNTS or words[-1] in COUNTS or words[-1] in ("length", "size", "count")


def panel_of(key: str) -> str | None:
    """The panel a training or evaluation metric is drawn in; None: a count (tabulated)."""
    if key in RATES:
        return RATES[key]
    if _is_count(key):
        return None
    words = _words(key)
    if re.fullmatch(r"clip(\d+_.*|_beta|_omega)", key):  # BD3-LM's clipped noise levels
        return "clip window" if words[-1] in ("beta", "omega") else "clip " + words[-1]
    if words[-1] in ("stderr", "std", "variance", "square"):
        return key.replace("_", " ")  # a spread, on a scale of its own
    if re.match(r"loss_t\d", key):  # the loss per noise level of a diffusion model
        return "loss per noise level"
    if words[0] == "logp":
        return "log-probabilities"
    for panel, marks in HEADLINES:
        if any(mark in words for mark in marks):
            return panel
    if words[-1] in ("loss", "mse") or "nll" in words:
        return "loss"
    if words[-1] == "norm":
        return "norms"
    if words[-1] == "fraction":
        return "fractions"
    return key.replace("_", " ")


def _label(key: str, kind: str, averaged: bool) -> str:
    """``loss (train)``, ``loss (eval)``, ``loss (eval, EMA)``: an evaluation row of
    the averaged weights (``ema``) holds the live weights' results as ``live/KEY``."""
    where = "train" if kind == "train" else ("eval, EMA" if averaged else "eval")
    return f"{key} ({where})"


def _metric(key: str, averaged: bool) -> tuple[str, bool]:
    if key.startswith("live/"):
        return key[len("live/") :], False
    return key, averaged


def panels(rows: list[dict]) -> tuple[dict[str, dict[str, tuple[list, list]]], dict]:
    """``({panel: {series label: (steps, values)}}, {label: last value})`` of a run's
    metric rows (``kind`` train and eval), panels in the page's order; counts, and
    the series of a panel that holds one value throughout, are tabulated instead."""
    grouped: dict[str, dict[str, tuple[list, list]]] = {}
    counts: dict[str, float] = {}
    for row in rows:
        kind = row.get("kind")
        if kind not in ("train", "eval") or not isinstance(row.get("step"), int):
            continue
        for key, value in row.items():
            if key in BOOKKEEPING or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            key, averaged = _metric(key, bool(row.get("ema")))
            panel = panel_of(key)
            if panel is None:
                counts[_label(key, kind, averaged)] = value
                continue
            if not math.isfinite(value):
                continue
            if panel == "loss per noise level":  # many levels: training and evaluation apart
                panel += " (train)" if kind == "train" else " (eval)"
            xs, ys = grouped.setdefault(panel, {}).setdefault(_label(key, kind, averaged), ([], []))
            xs.append(row["step"])
            ys.append(value)
    first = ["loss", *(name for name, _ in HEADLINES)]
    first += ["loss per noise level (train)", "loss per noise level (eval)"]
    last = ["fractions", "norms", *dict.fromkeys(RATES.values())]
    middle = sorted(p for p in grouped if p not in first and p not in last)
    order = [p for p in (*first, *middle, *last) if p in grouped]
    for panel in order:  # a panel of constants (no rejected step): its values tabulated
        series = grouped[panel]
        if len({y for _, ys in series.values() for y in ys}) == 1:
            counts.update({label: ys[-1] for label, (_, ys) in series.items()})
            del grouped[panel]
    return {p: grouped[p] for p in order if p in grouped}, counts


def _span_decades(series: dict) -> bool:
    values = [y for _, ys in series.values() for y in ys]
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SPAN


def _figure(
    title: str, series: dict, ylabel: str = "", log: bool | None = None, bars: bool = False
):
    """A PNG of ``series`` (580 x 280 pixels: two side by side on a laptop's screen),
    the legend outside the data on the right; ``log`` None: a log scale when the
    values span more than a decade; ``bars``: one stacked bar per step instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=SIZE, dpi=100)
    fig.subplots_adjust(left=0.12, right=0.64, bottom=0.16, top=0.9)
    colours = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors
    bottom: dict = {}
    for index, (name, (xs, ys)) in enumerate(series.items()):
        if bars:  # stacked: each step's phases one above the other
            at = [str(x) for x in xs]
            below = [bottom.get(x, 0.0) for x in at]
            ax.bar(at, ys, bottom=below, label=name, color=colours[index % len(colours)])
            bottom.update({x: b + y for x, b, y in zip(at, below, ys)})
            continue
        evaluation = "(eval" in name
        ax.plot(
            xs,
            ys,
            label=name,
            color=colours[index % len(colours)],
            linestyle="--" if evaluation else "-",
            marker="o" if evaluation or len(xs) < 30 else None,
            markersize=4,
        )
    ax.set_title(title)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps
    ax.set_xlabel("session, by the step it ended at" if bars else "step")
    if ylabel:
        ax.set_ylabel(ylabel)
    if log is None:
        log = _span_decades(series)
    if log:
        ax.set_yscale("log")
    if series:
        legend = ax.legend(
            fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0
        )
        fig.canvas.draw()  # the legend's width known: the axes make room for all of it
        share = legend.get_window_extent().width / fig.bbox.width
        fig.subplots_adjust(right=max(0.4, 0.97 - share - 0.02 * 0.64))
    ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue(), log


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "dew report draws with matplotlib, which is not installed: pip install "
            "'dew-jax[report]'; with uv: uv add 'dew-jax[report]' in your project, or "
            "uv sync --all-packages --extra report in a Dew checkout"
        ) from None


def _table(counts: dict) -> str:
    if not counts:
        return ""
    body = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v:,.6g}</td></tr>" for k, v in sorted(counts.items())
    )
    return (
        "<h2>counts and constants (last values)</h2><table class='counts'>"
        f"<tr><th>metric</th><th>last value</th></tr>{body}</table>"
    )


def write_report(run_dir: str, out: str | None = None) -> str:
    """Write ``report.html`` (and ``report/*.png``) for ``run_dir``; returns the page's path."""
    _require_matplotlib()
    rows = _rows(run_dir)
    grouped, counts = panels(rows)
    figures = []
    for title, series in grouped.items():
        png, log = _figure(title, series, log=False if title in LINEAR else None)
        figures.append((title, png, list(series), log))
    # one goodput record per session (each `dew train` / `dew resume`): its phases
    goodput = {
        k: v
        for k, v in _series_of(rows, "goodput").items()
        if k not in ("wall", "first_step", "time") and any(v[1])
    }
    png, log = _figure(
        "goodput: seconds per phase, per session", goodput, "s", log=False, bars=True
    )
    figures.append(("goodput", png, list(goodput), log))
    folder = os.path.join(run_dir, "report")
    os.makedirs(folder, exist_ok=True)
    parts = ["<h2>curves</h2><div class='panels'>"]
    for name, png, names, log in figures:
        with open(os.path.join(folder, name.replace(" ", "_") + ".png"), "wb") as f:
            f.write(png)
        data = base64.b64encode(png).decode()
        parts.append(
            f'<figure><img alt="{html.escape(name)}" data-series="{html.escape(json.dumps(names))}"'
            f' data-scale="{"log" if log else "linear"}" src="data:image/png;base64,{data}">'
            "</figure>"
        )
    parts.append("</div>")
    parts.append(_table(counts))
    previews = os.path.join(run_dir, "previews")
    if os.path.isdir(previews):
        names = sorted(os.listdir(previews))
        texts = [n for n in names if n.endswith(".txt")][-4:]
        if texts:
            parts.append("<h2>text previews</h2>")
        for name in texts:
            with open(os.path.join(previews, name), encoding="utf-8", errors="replace") as f:
                sample = f.read()
            parts.append(
                f'<figure class="text-preview"><pre>{html.escape(sample)}</pre>'
                f"<figcaption>{html.escape(name)}</figcaption></figure>"
            )
        latest = [n for n in names if n.endswith((".png", ".gif"))][-4:]
        for name in latest:
            with open(os.path.join(previews, name), "rb") as f:
                data = base64.b64encode(f.read()).decode()
            kind = "gif" if name.endswith(".gif") else "png"
            parts.append(
                f'<figure><img alt="preview {name}" src="data:image/{kind};base64,{data}">'
                f"<figcaption>{html.escape(name)}</figcaption></figure>"
            )
    status = {}
    if os.path.exists(os.path.join(run_dir, "status.json")):
        with open(os.path.join(run_dir, "status.json")) as f:
            status = json.load(f)
    recipe = ""
    if os.path.exists(os.path.join(run_dir, "recipe.yaml")):
        with open(os.path.join(run_dir, "recipe.yaml")) as f:
            recipe = f.read()
    title = html.escape(os.path.basename(os.path.abspath(run_dir)))
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>dew report: {title}</title>"
        "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
        ".panels{display:flex;flex-wrap:wrap}"
        "table.counts{border-collapse:collapse}table.counts td,table.counts th"
        "{border:1px solid #ccc;padding:.2em .6em;text-align:left}"
        "pre{background:#f4f4f4;padding:1em;max-height:30em;overflow:auto}</style></head><body>"
        f"<h1>{title}</h1><p>status: {html.escape(str(status.get('status', 'unknown')))}, "
        f"step {html.escape(str(status.get('step', '-')))}</p>"
        + "".join(parts)
        + f"<h2>recipe</h2><pre>{html.escape(recipe)}</pre></body></html>"
    )
    path = out or os.path.join(run_dir, "report.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def _series_of(rows, kind):
    out: dict[str, tuple[list, list]] = {}
    for row in rows:
        if row.get("kind") != kind:
            continue
        for key, value in row.items():
            if key in ("step", "kind", "time") or not isinstance(value, int | float):
                continue
            xs, ys = out.setdefault(key, ([], []))
            xs.append(row["step"])
            ys.append(value)
    return out
