"""A generation job's run report: ``_report.md`` and its plots (``_report/*.png``) from the output directory.

``write_report(out)`` reads what the job left in ``out`` (the part files' rows, ``_job.json`` and
``_summary.json`` when present) and writes::

    _report.md                 header (model, method, rows, samples, wall time, tokens/s, MAT, retrieval
                               success, errors), what the budget did, error messages, plots, tables
    _report/throughput.png     tokens/s over time (rows with ``finished_at``), else cumulative tokens
                               by row order
    _report/mat_hist.png       MAT (``mean_accepted``) per row
    _report/accepted_from.png  accepted draft tokens by source (``accepted_from``)

The names start with ``_`` like ``_job.json``: Parquet readers (pandas, ``pyarrow.dataset``, DuckDB)
skip them, where a ``report.md`` would make ``pd.read_parquet(out)`` fail. The rows need only the
columns the job writes (:func:`pipeline.io.output.output_schema`); a ``replica`` column (who generated
the row) and a ``finished_at`` column (when: epoch seconds or an Arrow timestamp), where present, add
the per-replica table and the time axis. :func:`budget_sentence` says in one line what the draft budget
did. ``python -m pipeline.job.report OUT`` writes the report from the command line.

Modules: :mod:`.data` reads the output directory and sums its rows, :mod:`.budget` puts what the draft
budget did in words, :mod:`.plots` draws the figures, :mod:`.markdown` writes the Markdown,
:mod:`.numbers` formats numbers; this package writes the files.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

from ...io.output import atomic_write
from ...numbers import pct, sig
from .budget import break_even_acceptance, budget_sentence, budget_stats
from .data import RunData, group_stats, load_run, log
from .markdown import render
from .plots import PLOTS, PLOTS_DIR, plot_accepted_from, plot_mat, plot_throughput

REPORT_FILE = "_report.md"

__all__ = ["PLOTS", "PLOTS_DIR", "REPORT_FILE", "RunData", "break_even_acceptance", "budget_sentence",
           "budget_stats", "group_stats", "load_run", "main", "pct", "render", "sig", "write_report",
           "write_report_quietly"]


def write_report(output_dir) -> pathlib.Path:
    """Write ``<output_dir>/_report.md`` and its plots under ``<output_dir>/_report/``; the report's path.
    ValueError naming the directory (or file) when it is not a generation job's output."""
    data = load_run(output_dir)
    plots = data.root / PLOTS_DIR
    plots.mkdir(exist_ok=True)
    s = group_stats(data.table)
    captions = {"throughput": plot_throughput(data, plots / PLOTS["throughput"])}
    plot_mat(data, plots / PLOTS["mat"], s["mean_accepted"])
    plot_accepted_from(s["accepted_from"], s["tokens"], plots / PLOTS["accepted_from"])
    path = data.root / REPORT_FILE
    text = render(data, captions)
    atomic_write(path, lambda fh: fh.write(text.encode()))
    return path


def write_report_quietly(output_dir) -> pathlib.Path | None:
    """:func:`write_report` for the end of a job: a report that cannot be written is a warning, never the
    job's failure."""
    try:
        path = write_report(output_dir)
    except Exception as e:  # noqa: BLE001 - the rows are written; the report is extra
        log.warning("no run report for %s: %s", output_dir, e)
        return None
    log.info("run report: %s", path)
    return path


def main(argv=None, prog: str = "python -m pipeline.job.report") -> int:
    """``python -m pipeline.job.report OUT`` (and ``logitspec report OUT``): write OUT's report, print its
    path; exit 2 on a directory that is not a job's output."""
    p = argparse.ArgumentParser(prog=prog, description="Write a generation job's run report "
                                f"({REPORT_FILE} and plots under {PLOTS_DIR}/) into its output directory.")
    p.add_argument("output", help="the job's --output directory")
    args = p.parse_args(argv)
    try:
        print(write_report(args.output))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
