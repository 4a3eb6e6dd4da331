"""``dew report RUN_DIR``: one self-contained HTML page (and the PNGs beside it)
of a run's training and evaluation curves, learning rate, throughput, the goodput
breakdown and the latest previews (images, and text samples as written), drawn
with matplotlib (``pip install 'dew-jax[report]'``); the images are embedded, so
the page opens anywhere."""

from __future__ import annotations

import base64
import html
import io
import json
import os

__all__ = ["write_report"]

THROUGHPUT = ("tokens_per_second", "examples_per_second")


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


def _series(rows, kind, keys=None):
    out: dict[str, tuple[list, list]] = {}
    for row in rows:
        if row.get("kind") != kind:
            continue
        for key, value in row.items():
            if key in ("step", "kind", "time") or not isinstance(value, int | float):
                continue
            if keys is not None and not any(k in key for k in keys):
                continue
            xs, ys = out.setdefault(key, ([], []))
            xs.append(row["step"])
            ys.append(value)
    return out


def _figure(title: str, series: dict, ylabel: str = "", log: bool = False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for name, (xs, ys) in sorted(series.items()):
        ax.plot(xs, ys, label=name, marker="." if len(xs) < 30 else None)
    ax.set_title(title)
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    if log and all(y > 0 for _, ys in series.values() for y in ys):
        ax.set_yscale("log")
    if series:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


def write_report(run_dir: str, out: str | None = None) -> str:
    """Write ``report.html`` (and ``report/*.png``) for ``run_dir``; returns the page's path."""
    rows = _rows(run_dir)
    train = _series(rows, "train")
    figures = []
    losses = {k: v for k, v in train.items() if k == "loss" or k.endswith("loss")}
    figures.append(("training loss", _figure("training loss", losses, "loss", log=True)))
    evals = _series(rows, "eval")
    evals.pop("ema", None)
    figures.append(("evaluation", _figure("evaluation", evals)))
    rates = {k: v for k, v in train.items() if k in ("learning_rate", "lr")}
    figures.append(("learning rate", _figure("learning rate", rates)))
    speed = {k: v for k, v in train.items() if any(t in k for t in THROUGHPUT)}
    figures.append(("throughput", _figure("throughput", speed)))
    # one goodput record per session (each `dew train` / `dew resume`): its phases
    goodput = {k: v for k, v in _series(rows, "goodput").items() if k not in ("wall", "first_step")}
    figures.append(("goodput", _figure("goodput: seconds per phase, per session", goodput, "s")))
    folder = os.path.join(run_dir, "report")
    os.makedirs(folder, exist_ok=True)
    parts = []
    for name, png in figures:
        with open(os.path.join(folder, name.replace(" ", "_") + ".png"), "wb") as f:
            f.write(png)
        data = base64.b64encode(png).decode()
        parts.append(f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>')
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
