"""A generation job's output directory as the run report reads it: its rows (the part files), ``_job.json``
and ``_summary.json`` (:func:`load_run`), and the statistics of some of its rows (:func:`group_stats`)."""
from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

log = logging.getLogger("pipeline.job.report")

JOB_FILE, SUMMARY_FILE = "_job.json", "_summary.json"
# columns a part file of a generation job has; without them a file is not one (the sweep's rows lack them)
REQUIRED = ("id", "n_new_tokens", "steps", "mean_accepted", "error")
OPTIONAL = ("sample", "accepted_lengths", "retrieval_success", "wall_s", "method", "model", "corpus",
            "accepted_from", "replica", "finished_at", "verified_steps")
TIME_COLUMN, REPLICA_COLUMN = "finished_at", "replica"


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class RunData:
    """What an output directory holds: its rows (``table``, files in write order), job record, summary."""

    root: pathlib.Path
    table: pa.Table
    files: list[pathlib.Path]
    job: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def part_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The Parquet files Parquet readers see (names not starting with ``_`` or ``.``), and those of the
    earlier layout (``generations/``), oldest first."""
    files = [f for f in root.glob("*.parquet") if not f.name.startswith(("_", ".")) and f.is_file()]
    files += [f for f in (root / "generations").glob("part-*.parquet") if f.is_file()]
    return sorted(files, key=lambda f: (f.stat().st_mtime, f.name))


def read_json(path: pathlib.Path) -> dict:
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
    files = part_files(root)
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
    return RunData(root, table, files, read_json(root / JOB_FILE), read_json(root / SUMMARY_FILE))


# ---------------------------------------------------------------------------------------------- statistics
def column(t: pa.Table, name: str, default=0.0) -> np.ndarray:
    """A numeric column as float64 (nulls and a missing column: ``default``)."""
    if name not in t.column_names:
        return np.full(t.num_rows, default, dtype=float)
    return pc.fill_null(t.column(name).cast(pa.float64()), default).to_numpy(zero_copy_only=False)


def ok_rows(t: pa.Table) -> pa.Table:
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


def accepted_steps(t: pa.Table) -> int | None:
    """Forwards that accepted at least one draft token (an ``accepted_lengths`` entry above 1; the
    prefill's entry is always 1), or None without the column."""
    if "accepted_lengths" not in t.column_names:
        return None
    flat = pc.list_flatten(t.column("accepted_lengths"))
    return int(pc.sum(pc.greater(flat, 1)).as_py() or 0)


def finish_times(t: pa.Table) -> np.ndarray | None:
    """``finished_at`` in seconds (epoch or any origin), or None when the rows have no such column."""
    if TIME_COLUMN not in t.column_names:
        return None
    col = t.column(TIME_COLUMN)
    if pa.types.is_timestamp(col.type):
        col = pc.divide(col.cast(pa.timestamp("us")).cast(pa.int64()).cast(pa.float64()), 1e6)
    return pc.fill_null(col.cast(pa.float64()), math.nan).to_numpy(zero_copy_only=False)


def replica_names(t: pa.Table) -> pa.ChunkedArray:
    """The rows' replica names as strings; "(none)" for rows no replica made (refused before dispatch)."""
    return pc.fill_null(t.column(REPLICA_COLUMN).cast(pa.string()), "(none)")


def span_s(t: pa.Table) -> float | None:
    """Seconds from the first row's start (``finished_at - wall_s``) to the last row's finish."""
    times = finish_times(t)
    if times is None or not np.isfinite(times).any():
        return None
    ok = np.isfinite(times)
    start = times[ok] - column(t, "wall_s")[ok]
    span = float(times[ok].max() - start.min())
    return span if span > 0 else None


def group_stats(t: pa.Table) -> dict:
    """Rows, errors, tokens, steps, MAT, retrieval success and the budget's step counts of some rows."""
    ok = ok_rows(t)
    tokens, steps = column(ok, "n_new_tokens"), column(ok, "steps")
    decode = np.maximum(steps - 1, 0)  # the prefill forward drafts nothing
    retrieval = column(ok, "retrieval_success", math.nan)
    known = np.isfinite(retrieval) & (decode > 0)
    span = span_s(t)
    verified = int(column(ok, "verified_steps").sum()) if "verified_steps" in ok.column_names else None
    return {
        "rows": t.num_rows, "errors": t.num_rows - ok.num_rows, "tokens": int(tokens.sum()),
        "steps": int(steps.sum()), "decode_steps": int(decode.sum()),
        "mean_accepted": float(tokens.sum() / steps.sum()) if steps.sum() else None,
        "retrieval_success": float((retrieval[known] * decode[known]).sum() / decode[known].sum())
        if known.any() and decode[known].sum() else None,
        "accepted_steps": accepted_steps(ok), "verified_steps": verified,
        "accepted_from": accepted_from(ok), "span_s": span,
        "tokens_per_s": float(tokens.sum() / span) if span else None,
    }
