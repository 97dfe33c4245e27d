"""The sweep's report files: the rows on disk scored and summarised (``report.json``, ``report.md``,
``report.png`` in ``--output``), with the run's timing, load and replicas."""
from __future__ import annotations

import logging
import os
import pathlib

from logitspec.evaluation.sweep_plot import plot_report
from logitspec.evaluation.sweep_report import build_report, report_markdown

from ..io.output import atomic_write_bytes, atomic_write_json
from ..replica.pool import RunRecord
from ..rows import SweepOutputRow
from .config import EvalConfig

log = logging.getLogger("pipeline.sweep.report")


def machine_load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (figures on a shared machine need them)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on Linux
        return None


def sweep_rows_on_disk(plan) -> list[dict]:
    """Every row the output holds (this run's and earlier runs')."""
    table = plan.store.read_existing(columns=SweepOutputRow.names())
    return table.to_pylist() if table is not None else []


def write_report(cfg: EvalConfig, plan, record: RunRecord) -> dict:
    """Score the rows of this sweep's examples and configurations, write the report files, return the
    report."""
    keys = {r.key for r in plan.rows}
    names = {c.name for c in cfg.configs}
    rows = [r for r in sweep_rows_on_disk(plan) if r["key"] in keys and r["config"] in names]
    report = build_report(rows, plan.data, [c.as_dict() for c in cfg.configs], lossless=True)
    stats = record.stats
    report["run"] = {
        "data": cfg.data, "model": cfg.model, "settings": cfg.record(), "max_batch_size": cfg.max_batch_size,
        "rows_per_task": cfg.rows_per_batch, "actors": cfg.actors,
        "truncated_rows": sum(r.truncated for r in plan.rows),
        "pairs_generated_now": sum(len(r.configs) for r in plan.todo), "pairs_already_done": plan.done_pairs,
        "timing": plan.timing, "load_average": machine_load(),
        "replicas": list(stats.replica_info) if stats is not None else [],
        "replicas_at_end": record.final, "deaths": stats.deaths if stats is not None else 0,
    }
    out = pathlib.Path(cfg.output)
    atomic_write_json(out / "report.json", report)
    title = f"Evaluation sweep: {cfg.model} on {cfg.data}"
    atomic_write_bytes(out / "report.md", report_markdown(report, title).encode())
    try:
        plot_report(report, out / "report.png")
    except Exception as e:  # noqa: BLE001 - the plot is a convenience; the numbers are in the JSON
        log.warning("cannot draw the plot: %s: %s", type(e).__name__, e)
    return report
