"""Training-curve plots (PNG) of the main metrics, drawn headless with matplotlib's Agg canvas."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rloo.diskspace import write_bytes_atomic

MAIN_CURVES = (
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "policy/entropy_avg",
    "val/ratio",
    "loss/policy_avg",
    "eps",
    "tools/call_frequency",  # agents' runs only (--tools, --environment)
    "tools/failure_frequency",
)


def plot_training_curves(
    history: Sequence[dict[str, Any]],
    out_png: str | Path,
    metrics: Sequence[str] = MAIN_CURVES,
    x_key: str = "update",
) -> Path | None:
    """One panel per metric of ``metrics`` present in ``history``; returns the PNG path, or None if none is."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for name in metrics:
        xs, ys = [], []
        for i, rec in enumerate(history):
            v = rec.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(float(rec.get(x_key, i + 1)))
                ys.append(float(v))
        if ys:
            series[name] = (xs, ys)
    if not series:
        return None
    # Figure + Agg canvas, not pyplot: no global backend state, safe outside the main thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(3, len(series))
    nrows = math.ceil(len(series) / ncols)
    width, height = 4.2 * ncols, 3.0 * nrows
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    # fixed margins (inches), not a constrained layout: measuring every label to place the panels took most
    # of the drawing time, and every panel here has the same furniture (a title, an x label, tick labels)
    fig.subplots_adjust(
        left=0.65 / width,
        right=1 - 0.2 / width,
        bottom=0.5 / height,
        top=1 - 0.35 / height,
        wspace=0.3,
        hspace=0.55,
    )
    for i, (name, (xs, ys)) in enumerate(series.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.4)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(x_key)
        ax.grid(True, alpha=0.3)
    out = Path(out_png)
    # rendered in memory, then written whole: a full disk leaves no 0-byte PNG behind, and says so in one line
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_bytes_atomic(out, buf.getvalue(), "the training-curve plot")
    return out
