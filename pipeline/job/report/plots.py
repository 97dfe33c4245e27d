"""The run report's figures (matplotlib, Agg), written as PNG files under ``_report/``."""
from __future__ import annotations

import math
import pathlib

import numpy as np

from ...io.output import atomic_write
from ...numbers import pct, sig
from .data import REPLICA_COLUMN, TIME_COLUMN, RunData, column, finish_times, ok_rows, replica_names

PLOTS_DIR = "_report"
PLOTS = {"throughput": "throughput.png", "mat": "mat_hist.png", "accepted_from": "accepted_from.png"}


def _figure(width: float = 6.4, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    atomic_write(path, lambda fh: fig.savefig(fh, format="png", dpi=100))


def plot_throughput(data: RunData, path: pathlib.Path) -> str:
    """Tokens/s over time from ``finished_at`` (per replica where rows name one), else cumulative new
    tokens by row order (files oldest first); returns the caption."""
    t = data.table
    fig, ax = _figure()
    times = finish_times(t)
    if times is not None and np.isfinite(times).any():
        ok = np.isfinite(times)
        tokens = column(t, "n_new_tokens")[ok]
        x = times[ok] - (times[ok] - column(t, "wall_s")[ok]).min()
        width = max(float(x.max()) / 30, 1.0)
        edges = np.arange(0.0, float(x.max()) + width, width)
        if len(edges) < 2:
            edges = np.array([0.0, width])
        groups = {"all rows": np.ones(len(x), bool)}
        if REPLICA_COLUMN in t.column_names:
            names = replica_names(t).to_numpy(zero_copy_only=False)[ok]
            for name in sorted(set(names)):
                groups[name] = names == name
        for label, m in groups.items():
            hist, _ = np.histogram(x[m], bins=edges, weights=tokens[m])
            style = {"color": "black", "linewidth": 2.0, "zorder": 3} if label == "all rows" else {}
            ax.stairs(hist / width, edges, label=label, **style)
        ax.set_xlabel("seconds since the first row started")
        ax.set_ylabel("new tokens/s")
        ax.set_title("Throughput over time (rows by finish time)")
        if len(groups) > 1:
            ax.legend(fontsize="small")
        caption = f"tokens/s over time, in {sig(width)} s bins of the rows' `{TIME_COLUMN}`"
    else:
        tokens = column(t, "n_new_tokens")
        ax.plot(np.arange(0, t.num_rows + 1), np.concatenate([[0.0], np.cumsum(tokens)]))
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("row (part files oldest first, rows in file order)")
        ax.set_ylabel("cumulative new tokens")
        ax.set_title("Cumulative new tokens by row order (rows carry no finish time)")
        caption = (f"the rows carry no finish time (no `{TIME_COLUMN}` column), so this is cumulative new "
                   f"tokens by row order, not tokens/s over time")
    _save(fig, path)
    return caption


def plot_mat(data: RunData, path: pathlib.Path, mat: float | None) -> None:
    values = column(ok_rows(data.table), "mean_accepted", math.nan)
    values = values[np.isfinite(values)]
    fig, ax = _figure()
    if len(values):
        lo, hi = float(values.min()), float(values.max())
        bins = np.linspace(lo, hi if hi > lo else lo + 0.1, min(30, max(5, len(values) // 4)) + 1)
        ax.hist(values, bins=bins, color="tab:blue", edgecolor="white")
    if mat is not None:
        ax.axvline(mat, color="black", linewidth=1, label=f"run MAT {sig(mat)}")
        ax.legend(fontsize="small")
    ax.set_xlabel("MAT of the row (new tokens per target forward, `mean_accepted`)")
    ax.set_ylabel("rows")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"MAT per row ({len(values):,} rows)")
    _save(fig, path)


def plot_accepted_from(split: dict[str, int], tokens: int, path: pathlib.Path) -> None:
    fig, ax = _figure()
    names = list(split) or ["(no accepted_from column)"]
    counts = [split.get(n, 0) for n in names]
    ax.barh(names[::-1], counts[::-1], color="tab:green")
    for i, c in enumerate(counts[::-1]):
        ax.text(c, i, f" {c:,} ({pct(c / tokens) if tokens else '-'})", va="center", fontsize="small")
    ax.set_xlim(0, max(counts + [1]) * 1.3)
    ax.set_xlabel("accepted draft tokens")
    drafted = sum(counts)
    ax.set_title(f"Accepted draft tokens by source: {drafted:,} of {tokens:,} new tokens"
                 if drafted else "No draft token was accepted")
    _save(fig, path)
