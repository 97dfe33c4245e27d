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
did. ``python -m pipeline.run_report OUT`` writes the report from the command line.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

log = logging.getLogger("pipeline.run_report")

REPORT_FILE = "_report.md"
PLOTS_DIR = "_report"
JOB_FILE, SUMMARY_FILE = "_job.json", "_summary.json"
# columns a part file of a generation job has; without them a file is not one (the sweep's rows lack them)
REQUIRED = ("id", "n_new_tokens", "steps", "mean_accepted", "error")
OPTIONAL = ("sample", "accepted_lengths", "retrieval_success", "wall_s", "method", "model", "corpus",
            "accepted_from", "replica", "finished_at", "verified_steps")
TIME_COLUMN, REPLICA_COLUMN = "finished_at", "replica"
SHOWN_ERRORS = 3  # distinct error messages quoted in the report
PLOTS = {"throughput": "throughput.png", "mat": "mat_hist.png", "accepted_from": "accepted_from.png"}


# ---------------------------------------------------------------------------------------------- numbers
def sig(x, digits: int = 3) -> str:
    """``x`` rounded to ``digits`` significant digits, in plain notation ("1.01", "0.0812", "12,300");
    "-" for None / NaN."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    decimals = digits - 1 - math.floor(math.log10(abs(x)))
    r = round(x, decimals)
    if r != 0 and math.floor(math.log10(abs(r))) != math.floor(math.log10(abs(x))):  # 9.996 -> 10.0
        decimals -= 1
        r = round(x, decimals)
    return f"{int(round(r)):,}" if decimals <= 0 else f"{r:.{decimals}f}"


def pct(share) -> str:
    """A share as a percentage of 3 significant digits, without trailing zeros ("12%", "8.12%")."""
    if share is None or (isinstance(share, float) and not math.isfinite(share)):
        return "-"
    s = sig(100.0 * share)
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s + "%"


def _seconds(s) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"
    if s >= 120:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{sig(s)} s"


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class RunData:
    """What an output directory holds: its rows (``table``, files in write order), job record, summary."""

    root: pathlib.Path
    table: pa.Table
    files: list[pathlib.Path]
    job: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def _part_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The Parquet files Parquet readers see (names not starting with ``_`` or ``.``), and those of the
    earlier layout (``generations/``), oldest first."""
    files = [f for f in root.glob("*.parquet") if not f.name.startswith(("_", ".")) and f.is_file()]
    files += [f for f in (root / "generations").glob("part-*.parquet") if f.is_file()]
    return sorted(files, key=lambda f: (f.stat().st_mtime, f.name))


def _read_json(path: pathlib.Path) -> dict:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s); the report leaves it out", path, e)
        return {}
    return doc if isinstance(doc, dict) else {}


def load_run(output_dir) -> RunData:
    """Read an output directory; ValueError naming it (or the foreign file) if it holds no job's rows."""
    root = pathlib.Path(output_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory (expected a generation job's --output)")
    files = _part_files(root)
    if not files:
        if (root / JOB_FILE).exists():
            raise ValueError(f"{root} holds no rows yet: no part files (part-*.parquet), though {JOB_FILE} "
                             f"says a job started there")
        raise ValueError(f"{root} holds no part files (part-*.parquet): not a generation job's output")
    tables = []
    for f in files:
        try:
            names = pq.read_schema(f).names
        except (OSError, pa.ArrowException) as e:
            raise ValueError(f"{f} is not a readable Parquet file ({e}): not a generation job's "
                             f"output") from None
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            names = ", ".join(map(repr, missing))
            raise ValueError(f"{f} is not a part file of a generation job: no column {names} (in {root})")
        tables.append(pq.read_table(f, columns=[c for c in (*REQUIRED, *OPTIONAL) if c in names]))
    table = pa.concat_tables(tables, promote_options="permissive")
    return RunData(root, table, files, _read_json(root / JOB_FILE), _read_json(root / SUMMARY_FILE))


# ---------------------------------------------------------------------------------------------- figures
def _col(t: pa.Table, name: str, default=0.0) -> np.ndarray:
    """A numeric column as float64 (nulls and a missing column: ``default``)."""
    if name not in t.column_names:
        return np.full(t.num_rows, default, dtype=float)
    return pc.fill_null(t.column(name).cast(pa.float64()), default).to_numpy(zero_copy_only=False)


def _ok(t: pa.Table) -> pa.Table:
    return t.filter(pc.is_null(t.column("error")))


def accepted_from(t: pa.Table) -> dict[str, int]:
    """Accepted draft tokens by source, summed over rows: the ``accepted_from`` struct's fields, or
    ``accepted_from_<source>`` columns."""
    out: dict[str, int] = {}
    if "accepted_from" in t.column_names:
        col = t.column("accepted_from")
        if pa.types.is_struct(col.type):
            for i in range(col.type.num_fields):
                name = col.type.field(i).name
                out[name] = int(pc.sum(pc.struct_field(col, [i])).as_py() or 0)
    for name in t.column_names:
        if name.startswith("accepted_from_"):
            out[name[len("accepted_from_"):]] = int(pc.sum(t.column(name)).as_py() or 0)
    return out


def _accepted_steps(t: pa.Table) -> int | None:
    """Forwards that accepted at least one draft token (an ``accepted_lengths`` entry above 1; the
    prefill's entry is always 1), or None without the column."""
    if "accepted_lengths" not in t.column_names:
        return None
    flat = pc.list_flatten(t.column("accepted_lengths"))
    return int(pc.sum(pc.greater(flat, 1)).as_py() or 0)


def _times(t: pa.Table) -> np.ndarray | None:
    """``finished_at`` in seconds (epoch or any origin), or None when the rows have no such column."""
    if TIME_COLUMN not in t.column_names:
        return None
    col = t.column(TIME_COLUMN)
    if pa.types.is_timestamp(col.type):
        col = pc.divide(col.cast(pa.timestamp("us")).cast(pa.int64()).cast(pa.float64()), 1e6)
    return pc.fill_null(col.cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)


def _replica_names(t: pa.Table) -> pa.ChunkedArray:
    """The rows' replica names as strings; "(none)" for rows no replica made (refused before dispatch)."""
    return pc.fill_null(t.column(REPLICA_COLUMN).cast(pa.string()), "(none)")


def _span(t: pa.Table) -> float | None:
    """Seconds from the first row's start (``finished_at - wall_s``) to the last row's finish."""
    times = _times(t)
    if times is None or not np.isfinite(times).any():
        return None
    ok = np.isfinite(times)
    start = times[ok] - _col(t, "wall_s")[ok]
    span = float(times[ok].max() - start.min())
    return span if span > 0 else None


def group_stats(t: pa.Table) -> dict:
    """Rows, errors, tokens, steps, MAT, retrieval success and the budget's step counts of some rows."""
    ok = _ok(t)
    tokens, steps = _col(ok, "n_new_tokens"), _col(ok, "steps")
    decode = np.maximum(steps - 1, 0)  # the prefill forward drafts nothing
    retrieval = _col(ok, "retrieval_success", math.nan)
    known = np.isfinite(retrieval) & (decode > 0)
    span = _span(t)
    verified = int(_col(ok, "verified_steps").sum()) if "verified_steps" in ok.column_names else None
    return {
        "rows": t.num_rows, "errors": t.num_rows - ok.num_rows, "tokens": int(tokens.sum()),
        "steps": int(steps.sum()), "decode_steps": int(decode.sum()),
        "mean_accepted": float(tokens.sum() / steps.sum()) if steps.sum() else None,
        "retrieval_success": float((retrieval[known] * decode[known]).sum() / decode[known].sum())
        if known.any() and decode[known].sum() else None,
        "accepted_steps": _accepted_steps(ok), "verified_steps": verified,
        "accepted_from": accepted_from(ok), "span_s": span,
        "tokens_per_s": float(tokens.sum() / span) if span else None,
    }


# ---------------------------------------------------------------------------------------------- budget
def break_even_acceptance(curve, batch: int) -> float:
    """The acceptance rate at which one draft token per row pays at ``batch`` rows, from a cost curve
    (``curve.step(rows, per_row)``: forward seconds, e.g. :class:`logitspec.budget.CostCurve`): a
    2-token forward gives 1 + p tokens where a 1-token one gives 1, so it pays when
    p > step(batch, 2) / step(batch, 1) - 1 (at least 1: no rate pays)."""
    one = curve.step(int(batch), 1)
    return max(0.0, curve.step(int(batch), 2) / one - 1.0) if one > 0 else math.nan


def budget_stats(data: RunData, t: pa.Table | None = None) -> dict:
    """The statistics :func:`budget_sentence` reads, for the rows ``t`` (default: all) of a run."""
    t = data.table if t is None else t
    s, summ = group_stats(t), data.summary
    gen = (summ.get("config") or {}).get("gen") or {}
    engine = summ.get("engine") or {}
    startup = (summ.get("replicas") or {}).get("startup") or [{}]
    method = data.job.get("method") or gen.get("method")
    if not method and "method" in t.column_names:
        methods = [m for m in pc.unique(t.column("method")).to_pylist() if m]
        method = methods[0] if len(methods) == 1 else None
    return {"method": method, "budget": gen.get("budget"), "decode_steps": s["decode_steps"],
            "verified_steps": s["verified_steps"], "accepted_steps": s["accepted_steps"],
            "mean_accepted": s["mean_accepted"], "retrieval_success": s["retrieval_success"],
            "batch": engine.get("mean_active") or gen.get("max_batch_size"),
            "break_even": engine.get("break_even"), "device": (startup[0] or {}).get("device")}


def budget_sentence(stats: dict) -> str:
    """What the draft budget did, in one line, from ``stats``: ``method``, ``decode_steps`` (forwards
    after the prefill, summed over rows), ``verified_steps`` (those that verified a draft; None when
    not recorded), ``accepted_steps`` (those that accepted a draft token), ``mean_accepted`` (MAT),
    ``retrieval_success`` (share of decode steps where retrieval found a draft), ``batch`` (rows per
    forward), ``break_even`` (the acceptance rate a draft token needs to pay at that batch, see
    :func:`break_even_acceptance`; None when not recorded) and ``device`` ("cpu", "cuda:0", ...)."""
    mat = stats.get("mean_accepted")
    if stats.get("method") == "ar":
        return f"method ar: plain decoding, no drafts (MAT {sig(mat)})"
    decode = stats.get("decode_steps") or 0
    if not decode:
        return "no decoding step after the prefill: nothing to say about the draft budget"
    verified, accepted = stats.get("verified_steps"), stats.get("accepted_steps")
    retrieval = stats.get("retrieval_success")
    found = f"; retrieval found a draft on {pct(retrieval)} of steps" if retrieval else ""
    if verified == 0 or (verified is None and accepted == 0):
        what = "verified" if verified == 0 else "accepted"
        head = f"decoded plainly: drafts {what} on 0 of {decode:,} steps (MAT {sig(mat)}{found})"
    elif verified is not None:
        head = f"drafts verified on {pct(verified / decode)} of steps"
        if accepted is not None:
            head += f", accepted on {pct(accepted / decode)}"
        head += f" (MAT {sig(mat)})"
    elif accepted is not None:
        head = f"drafts accepted on {pct(accepted / decode)} of steps (MAT {sig(mat)}{found})"
    else:
        head = f"MAT {sig(mat)}{found}"
    batch, be, device = stats.get("batch"), stats.get("break_even"), stats.get("device")
    kind = "GPU" if device and str(device).startswith("cuda") else "CPU" if device else "machine"
    where = f"on this {kind}"
    if batch:
        where = f"at batch {int(batch) if float(batch).is_integer() else sig(batch)} {where}"
    if be is None or (isinstance(be, float) and not math.isfinite(be)):
        return f"{head}, {where}" if batch or device else head
    if be >= 1:
        return (f"{head}: {where} no acceptance rate pays for a draft token (a 2-token forward costs "
                f"{sig(1 + be)}x a 1-token one)")
    return f"{head}: {where} a draft token must be accepted {pct(be)} of the time to pay"


# ---------------------------------------------------------------------------------------------- plots
def _figure(width: float = 6.4, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    _atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=100))


def plot_throughput(data: RunData, path: pathlib.Path) -> str:
    """Tokens/s over time from ``finished_at`` (per replica where rows name one), else cumulative new
    tokens by row order (files oldest first); returns the caption."""
    t = data.table
    fig, ax = _figure()
    times = _times(t)
    if times is not None and np.isfinite(times).any():
        ok = np.isfinite(times)
        tokens = _col(t, "n_new_tokens")[ok]
        x = times[ok] - (times[ok] - _col(t, "wall_s")[ok]).min()
        width = max(float(x.max()) / 30, 1.0)
        edges = np.arange(0.0, float(x.max()) + width, width)
        if len(edges) < 2:
            edges = np.array([0.0, width])
        groups = {"all rows": np.ones(len(x), bool)}
        if REPLICA_COLUMN in t.column_names:
            names = _replica_names(t).to_numpy(zero_copy_only=False)[ok]
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
        tokens = _col(t, "n_new_tokens")
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
    values = _col(_ok(data.table), "mean_accepted", math.nan)
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


# ---------------------------------------------------------------------------------------------- markdown
def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _model(data: RunData) -> str:
    name = data.job.get("model")
    path = data.summary.get("model_path")
    if "model" in data.table.column_names:
        names = [m for m in pc.unique(data.table.column("model")).to_pylist() if m]
        name = name or ", ".join(map(str, names)) or None
    if path and name and pathlib.Path(path).name != name:
        return f"{name} ({pathlib.Path(path).name})"
    return str(name or (pathlib.Path(path).name if path else "-"))


def _samples(data: RunData) -> str:
    n = (data.summary.get("rows") or {}).get("num_samples")
    if n is None and "sample" in data.table.column_names and data.table.num_rows:
        n = int(pc.max(data.table.column("sample")).as_py() or 0) + 1
    return f"{n} per input row" if n is not None else "-"


def _errors(t: pa.Table) -> list[str]:
    bad = t.filter(pc.is_valid(t.column("error")))
    if not bad.num_rows:
        return []
    counts = bad.group_by("error").aggregate([("error", "count")]).to_pylist()
    first = {m: i for i, m in reversed(list(enumerate(bad.column("error").to_pylist())))}  # first row of each
    counts.sort(key=lambda r: first[r["error"]])
    lines = [f"{bad.num_rows:,} error row(s); the first messages:", ""]
    for r in counts[:SHOWN_ERRORS]:
        msg = " ".join(str(r["error"]).split())
        msg = msg if len(msg) <= 300 else msg[:297] + "..."
        lines.append(f"- `{msg.replace('`', chr(39))}` ({r['error_count']:,} row(s))")
    if len(counts) > SHOWN_ERRORS:
        lines.append(f"- ... and {len(counts) - SHOWN_ERRORS} other message(s)")
    return lines


def _replica_section(data: RunData) -> tuple[list[str], list[str]]:
    """The per-replica table (rows that name their replica), else what the summary says of the replicas;
    and the missing fields to note."""
    t = data.table
    if REPLICA_COLUMN in t.column_names:
        col = _replica_names(t)
        rows = []
        for name in sorted(pc.unique(col).to_pylist()):
            sub = t.filter(pc.equal(col, name))
            s = group_stats(sub)
            rows.append([name, f"{s['rows']:,}", f"{s['errors']:,}", f"{s['tokens']:,}",
                         sig(s["tokens_per_s"]), sig(s["mean_accepted"]),
                         budget_sentence(budget_stats(data, sub))])
        header = ["replica", "rows", "errors", "new tokens", "tokens/s", "MAT", "what the budget did"]
        return _table(header, rows), []
    startup = (data.summary.get("replicas") or {}).get("startup") or []
    lines = [f"The rows do not name the replica that generated them (no `{REPLICA_COLUMN}` column), so rows, "
             f"tokens, tokens/s and MAT cannot be split by replica."]
    if startup:
        lines += ["", "Replicas the run started (from `_summary.json`):", ""]
        lines += _table(["replica", "device", "threads", "ready after"],
                        [[str(i.get("name", "-")), str(i.get("device", "-")), str(i.get("threads", "-")),
                          _seconds(i.get("ready_s"))] for i in startup])
    return lines, [f"`{REPLICA_COLUMN}` (string, the actor's name) on every row: the per-replica table"]


def render(data: RunData, captions: dict[str, str]) -> str:
    """The Markdown of the report (plots already written under ``_report/``)."""
    t, summ = data.table, data.summary
    s = group_stats(t)
    gen = (summ.get("config") or {}).get("gen") or {}
    budget = budget_stats(data)
    timing = summ.get("timing") or {}
    rows_info = summ.get("rows") or {}
    missing: list[str] = []

    gen_s, total_s = timing.get("generation_s"), timing.get("total_s")
    if gen_s is not None:
        wall = f"{_seconds(gen_s)} generating"
        if total_s is not None:
            wall += f", {_seconds(total_s)} in all"
    elif total_s is not None and s["span_s"] is None:
        wall = f"{_seconds(total_s)} in all (no generation time recorded)"
    elif s["span_s"] is not None:
        wall = f"{_seconds(s['span_s'])} (first row started to last row finished)"
    else:
        wall = "not recorded (no `_summary.json`)"
    per_s = (summ.get("tokens") or {}).get("per_s")
    tps = (f"{sig(per_s)} (this run's new tokens over its generation time)" if per_s is not None
           else f"{sig(s['tokens_per_s'])} (from the rows' finish times)" if s["tokens_per_s"] is not None
           else "not recorded")
    method = budget["method"] or "-"
    if gen.get("budget") and method == "logitspec":
        method += f" (budget {gen['budget']}, batch up to {gen.get('max_batch_size', '-')})"
    rows = f"{s['rows']:,} ({s['rows'] - s['errors']:,} generated, {s['errors']:,} error rows)"
    if rows_info.get("total") is not None:
        total = rows_info["total"]
        rows += f"; {total - rows_info.get('missing', 0):,} of {total:,} input keys done"
    status = "-"
    if summ:
        status = "complete" if summ.get("complete") else "incomplete"
        if summ.get("error"):
            status += f" ({' '.join(str(summ['error']).split())[:200]})"
    header = [
        ["model", _model(data)], ["method", method], ["rows", rows], ["samples", _samples(data)],
        ["wall time", wall], ["tokens/s", tps], ["new tokens", f"{s['tokens']:,}"],
        ["MAT", f"{sig(s['mean_accepted'])} new tokens per target forward"],
        ["retrieval success", f"{pct(s['retrieval_success'])} of decoding steps found a draft"],
        ["errors", f"{s['errors']:,}"], ["run", status],
    ]
    note = "" if summ else "; no `_summary.json` (the run is going on, or ended before writing it)"
    lines = [f"# Run report: {data.root.name}", "",
             f"Output directory `{data.root}`: {len(data.files)} part file(s){note}.", "",
             *_table(["", ""], header), "", f"**What the budget did:** {budget_sentence(budget)}", ""]
    if budget["verified_steps"] is None:
        missing.append("`verified_steps` per row (decode steps whose draft tree had a node, from "
                       "`SequenceStats.tree_sizes`): \"verified on X% of steps\" (the line says "
                       "\"accepted\")")
    if budget["break_even"] is None and budget["method"] not in ("ar", None):
        missing.append("`engine.break_even` in `_summary.json` (the acceptance a draft token needs at the "
                       "run's batch, `pipeline.run_report.break_even_acceptance(engine.cost_curve, batch)`): "
                       "the \"must be accepted X% of the time to pay\" clause")
    errors = _errors(t)
    if errors:
        lines += ["## Errors", "", *errors, ""]
    lines += ["## Throughput", "", f"![throughput]({PLOTS_DIR}/{PLOTS['throughput']})", "",
              captions["throughput"][:1].upper() + captions["throughput"][1:] + ".", ""]
    if TIME_COLUMN not in t.column_names:
        missing.append(f"`{TIME_COLUMN}` per row (float64 epoch seconds, `time.time()` when the row "
                       "finished): tokens/s over time, per-replica tokens/s")
    mats = _col(_ok(t), "mean_accepted", math.nan)
    mats = mats[np.isfinite(mats)]
    lines += ["## MAT per row", "", f"![MAT per row]({PLOTS_DIR}/{PLOTS['mat']})", ""]
    if len(mats):
        q = np.percentile(mats, [0, 50, 90, 100])
        lines += [f"Rows' MAT: min {sig(q[0])}, median {sig(q[1])}, 90th percentile {sig(q[2])}, "
                  f"max {sig(q[3])}; {int((mats > 1).sum()):,} of {len(mats):,} rows above 1.", ""]
    split = s["accepted_from"]
    drafted = sum(split.values())
    lines += ["## Accepted draft tokens by source", "",
              f"![accepted from]({PLOTS_DIR}/{PLOTS['accepted_from']})", ""]
    if split:
        tokens = s["tokens"]
        shares = [*split.items(), ("one per target forward", tokens - drafted)]
        lines += _table(["source", "accepted draft tokens", "share of new tokens"],
                        [[n, f"{c:,}", pct(c / tokens) if tokens else "-"] for n, c in shares])
        lines.append("")
    else:
        missing.append("`accepted_from` (struct of accepted draft tokens by source): the accepted-from split")
    replica_lines, replica_missing = _replica_section(data)
    lines += ["## Per replica", "", *replica_lines, ""]
    missing += replica_missing
    if "corpus" in t.column_names and len(pc.unique(t.column("corpus"))) > 1:
        rows = []
        names = pc.fill_null(t.column("corpus").cast(pa.string()), "(none)")
        for name in sorted(set(names.to_pylist())):
            g = group_stats(t.filter(pc.equal(names, name)))
            rows.append([name, f"{g['rows']:,}", f"{g['errors']:,}", f"{g['tokens']:,}",
                         sig(g["mean_accepted"]), pct(g["retrieval_success"])])
        header = ["corpus", "rows", "errors", "new tokens", "MAT", "retrieval success"]
        lines += ["## Per corpus", "", *_table(header, rows), ""]
    if missing:
        lines += ["## What the rows do not record", "", "Fields the job would need to write for the rest of "
                  "this report:", "", *(f"- {m}" for m in missing), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- writing
def _atomic(path: pathlib.Path, write) -> None:
    """``write(binary file)`` into a hidden temporary sibling, then rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


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
    _atomic(path, lambda fh: fh.write(text.encode()))
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


def main(argv=None, prog: str = "python -m pipeline.run_report") -> int:
    """``python -m pipeline.run_report OUT`` (and ``logitspec report OUT``): write OUT's report, print its
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


if __name__ == "__main__":
    sys.exit(main())
