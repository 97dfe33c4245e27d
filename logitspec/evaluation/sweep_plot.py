"""The sweep report's plot: per dataset, each configuration's decode-only and end-to-end speed-up over
its ``ar`` baseline, and its score."""

from __future__ import annotations

import os

__all__ = ["plot_report"]

PANELS = (("decode_speedup", "decode-only speed-up vs ar"), ("e2e_speedup", "end-to-end speed-up vs ar"),
          ("score", "score"))


def plot_report(report: dict, path: str | os.PathLike) -> None:
    """Write a PNG with one grouped bar panel per figure of :data:`PANELS` (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(report["datasets"])
    names = [c["name"] for c in report["configs"]]
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(max(6.0, 1.6 * len(datasets) + 2), 9), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for ax, (field, label) in zip(axes[:, 0], PANELS):
        for i, name in enumerate(names):
            values = [report["datasets"][ds][name].get(field) for ds in datasets]
            xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(datasets))]
            ax.bar(xs, [v if v is not None else 0.0 for v in values], width, label=name)
        if field != "score":
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(datasets)), datasets, rotation=15, fontsize=8)
        ax.set_ylabel(label, fontsize=9)
    axes[0, 0].legend(fontsize=7, ncol=min(len(names), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
