"""The Markdown of the run report (``_report.md``): header table, what the budget did, errors, plots
with their captions, per-replica and per-corpus tables, and the fields the rows do not record."""
from __future__ import annotations

import math
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logitspec.spec_decode.policy import BUDGETED

from ...numbers import pct, seconds, sig
from .budget import budget_sentence, budget_stats
from .data import REPLICA_COLUMN, TIME_COLUMN, RunData, column, group_stats, ok_rows, replica_names
from .plots import PLOTS, PLOTS_DIR

SHOWN_ERRORS = 3  # distinct error messages quoted in the report


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
        col = replica_names(t)
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
                          seconds(i.get("ready_s"))] for i in startup])
    return lines, [f"`{REPLICA_COLUMN}` (string, the actor's name) on every row: the per-replica table"]


def _wall_time(summ: dict, span_s: float | None) -> str:
    """The run's wall time in words: generation and total time from the summary, else the rows' span."""
    timing = summ.get("timing") or {}
    gen_s, total_s = timing.get("generation_s"), timing.get("total_s")
    if gen_s is not None:
        wall = f"{seconds(gen_s)} generating"
        if total_s is not None:
            wall += f", {seconds(total_s)} in all"
        return wall
    if total_s is not None and span_s is None:
        return f"{seconds(total_s)} in all (no generation time recorded)"
    if span_s is not None:
        return f"{seconds(span_s)} (first row started to last row finished)"
    return "not recorded (no `_summary.json`)"


def _header(data: RunData, s: dict, budget: dict) -> list[list[str]]:
    """The header table's rows: model, method, rows, samples, wall time, tokens/s, MAT, errors, status."""
    summ = data.summary
    gen = (summ.get("config") or {}).get("gen") or {}
    rows_info = summ.get("rows") or {}
    per_s = (summ.get("tokens") or {}).get("per_s")
    tps = (f"{sig(per_s)} (this run's new tokens over its generation time)" if per_s is not None
           else f"{sig(s['tokens_per_s'])} (from the rows' finish times)" if s["tokens_per_s"] is not None
           else "not recorded")
    method = budget["method"] or "-"
    if gen.get("budget") and method in BUDGETED:
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
    return [
        ["model", _model(data)], ["method", method], ["rows", rows], ["samples", _samples(data)],
        ["wall time", _wall_time(summ, s["span_s"])], ["tokens/s", tps], ["new tokens", f"{s['tokens']:,}"],
        ["MAT", f"{sig(s['mean_accepted'])} new tokens per target forward"],
        ["retrieval success", f"{pct(s['retrieval_success'])} of decoding steps found a draft"],
        ["errors", f"{s['errors']:,}"], ["run", status],
    ]


def _budget_missing(budget: dict) -> list[str]:
    """The fields the budget line would need that the run did not record."""
    missing = []
    if budget["verified_steps"] is None:
        missing.append("`verified_steps` per row (decode steps whose draft tree had a node, from "
                       "`SequenceStats.tree_sizes`): \"verified on X% of steps\" (the line says "
                       "\"accepted\")")
    if budget["break_even"] is None and budget["method"] not in ("ar", None):
        missing.append("`engine.break_even` in `_summary.json` (the acceptance a draft token needs at the "
                       "run's batch, `pipeline.job.report.break_even_acceptance(engine.cost_curve, batch)`): "
                       "the \"must be accepted X% of the time to pay\" clause")
    return missing


def _plot_sections(t: pa.Table, s: dict, captions: dict[str, str]) -> tuple[list[str], list[str]]:
    """The throughput, MAT and accepted-from sections (each a plot and its words); the missing fields."""
    missing: list[str] = []
    lines = ["## Throughput", "", f"![throughput]({PLOTS_DIR}/{PLOTS['throughput']})", "",
             captions["throughput"][:1].upper() + captions["throughput"][1:] + ".", ""]
    if TIME_COLUMN not in t.column_names:
        missing.append(f"`{TIME_COLUMN}` per row (float64 epoch seconds, `time.time()` when the row "
                       "finished): tokens/s over time, per-replica tokens/s")
    mats = column(ok_rows(t), "mean_accepted", math.nan)
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
    return lines, missing


def _corpus_section(t: pa.Table) -> list[str]:
    """The per-corpus table, when the rows come from more than one corpus."""
    if "corpus" not in t.column_names or len(pc.unique(t.column("corpus"))) <= 1:
        return []
    rows = []
    names = pc.fill_null(t.column("corpus").cast(pa.string()), "(none)")
    for name in sorted(set(names.to_pylist())):
        g = group_stats(t.filter(pc.equal(names, name)))
        rows.append([name, f"{g['rows']:,}", f"{g['errors']:,}", f"{g['tokens']:,}",
                     sig(g["mean_accepted"]), pct(g["retrieval_success"])])
    header = ["corpus", "rows", "errors", "new tokens", "MAT", "retrieval success"]
    return ["## Per corpus", "", *_table(header, rows), ""]


def render(data: RunData, captions: dict[str, str]) -> str:
    """The Markdown of the report (plots already written under ``_report/``)."""
    t = data.table
    s = group_stats(t)
    budget = budget_stats(data)
    note = "" if data.summary else "; no `_summary.json` (the run is going on, or ended before writing it)"
    lines = [f"# Run report: {data.root.name}", "",
             f"Output directory `{data.root}`: {len(data.files)} part file(s){note}.", "",
             *_table(["", ""], _header(data, s, budget)), "",
             f"**What the budget did:** {budget_sentence(budget)}", ""]
    missing = _budget_missing(budget)
    errors = _errors(t)
    if errors:
        lines += ["## Errors", "", *errors, ""]
    plot_lines, plot_missing = _plot_sections(t, s, captions)
    replica_lines, replica_missing = _replica_section(data)
    lines += [*plot_lines, "## Per replica", "", *replica_lines, "", *_corpus_section(t)]
    missing += plot_missing + replica_missing
    if missing:
        lines += ["## What the rows do not record", "", "Fields the job would need to write for the rest of "
                  "this report:", "", *(f"- {m}" for m in missing), ""]
    return "\n".join(lines)
