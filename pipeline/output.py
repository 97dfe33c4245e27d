"""The output directory: atomic Parquet part files, the job record, the summary.

Layout of ``--output``::

    generations/part-<hash>.parquet   one file per finished batch (the rows of the batch, any order)
    job.json                          the settings the rows were generated with (checked on resume)
    summary.json                      written at the end of a run; removed when a new run starts

Every file is written to a hidden temporary sibling and renamed into place (after fsync), so a crash
leaves either the whole file or none: a visible part file is always complete, and readers
(``pyarrow.parquet.read_table(out / "generations")``) skip the hidden temporaries. The driver is the
only writer and never writes an id twice, so the output holds each input row exactly once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from .config import ConfigError

log = logging.getLogger("pipeline.output")

PARTS_DIR = "generations"
JOB_FILE = "job.json"
SUMMARY_FILE = "summary.json"


def output_schema(id_type: pa.DataType) -> pa.Schema:
    return pa.schema([
        ("id", id_type),
        ("generation", pa.string()),
        ("finish_reason", pa.string()),
        ("n_prompt_tokens", pa.int32()),
        ("n_new_tokens", pa.int32()),
        ("steps", pa.int32()),
        ("mean_accepted", pa.float64()),
        ("accepted_lengths", pa.list_(pa.int32())),
        ("retrieval_success", pa.float64()),
        ("wall_s", pa.float64()),
        ("method", pa.string()),
        ("model", pa.string()),
        ("error", pa.string()),
        ("corpus", pa.string()),
    ])


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def new_file_mode() -> int:
    """The mode a plain ``open()`` would give a new file (0666 less the umask); ``mkstemp`` makes 0600 files."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, new_file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


class OutputStore:
    """Writes part files and knows which ids the output already holds."""

    def __init__(self, root: str | os.PathLike, id_type: pa.DataType):
        self.root = pathlib.Path(root).expanduser()
        self.parts = self.root / PARTS_DIR
        self.schema = output_schema(id_type)
        self.written: set = set()
        self.parts_written = 0

    # ------------------------------------------------------------------ start of a run
    def prepare(self, job: dict, overwrite: bool) -> pa.Table | None:
        """Make the directory ready for this run; returns the rows already present (None if none).

        ``overwrite`` removes this job's files (parts, job.json, summary.json) and nothing else.
        Otherwise, if rows were written already, the previous run's ``job.json`` must match ``job`` (same
        model, method, sampling ...), or ConfigError: mixing generations made with different settings
        would be silently wrong.
        """
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--output {str(self.root)!r} exists and is not a directory")
        if overwrite:
            shutil.rmtree(self.parts, ignore_errors=True)
            for f in (JOB_FILE, SUMMARY_FILE):
                (self.root / f).unlink(missing_ok=True)
        self.parts.mkdir(parents=True, exist_ok=True)
        for tmp in self.parts.glob(".*.tmp"):  # a crashed run's unfinished part: never visible, remove it
            tmp.unlink(missing_ok=True)
        job_path = self.root / JOB_FILE
        if job_path.exists() and self.part_files():  # with no rows written yet, the new settings simply apply
            try:
                previous = json.loads(job_path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"cannot read {job_path}: {e}; use --overwrite to start over") from None
            diff = {k: (previous.get(k), v) for k, v in job.items() if previous.get(k) != v}
            if diff:
                lines = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
                raise ConfigError(f"{self.root} holds output of a job with other settings ({lines}); "
                                  f"use --overwrite to start over or choose another --output")
        else:
            atomic_write_json(job_path, job)
        (self.root / SUMMARY_FILE).unlink(missing_ok=True)  # a stale summary must never describe this run
        existing = self.read_existing()
        if existing is not None:
            self.written = set(existing.column("id").to_pylist())
        return existing

    def part_files(self) -> list[pathlib.Path]:
        return sorted(self.parts.glob("part-*.parquet"))

    def read_existing(self, columns: Iterable[str] = ("id", "error", "n_new_tokens", "steps", "corpus")
                      ) -> pa.Table | None:
        tables = []
        for f in self.part_files():
            try:
                t = pq.read_table(f, columns=list(columns))
            except (OSError, pa.ArrowException) as e:
                raise ConfigError(f"cannot read the existing part file {f}: {e}; delete it or use --overwrite") from None
            if t.schema.field("id").type != self.schema.field("id").type:
                raise ConfigError(f"{f} has ids of type {t.schema.field('id').type}, the input's are "
                                  f"{self.schema.field('id').type}; use --overwrite or another --output")
            tables.append(t)
        return pa.concat_tables(tables) if tables else None

    # ------------------------------------------------------------------ during the run
    def write(self, rows: list[dict]) -> pathlib.Path | None:
        """Write the rows whose ids are not in the output yet as one part file (atomically)."""
        fresh, seen = [], set()
        for r in rows:
            if r["id"] in self.written or r["id"] in seen:
                log.warning("row %r is already in the output; not writing it again", r["id"])
                continue
            seen.add(r["id"])
            fresh.append(r)
        if not fresh:
            return None
        ids = sorted(str(r["id"]) for r in fresh)
        name = "part-" + hashlib.sha1("\x00".join(ids).encode()).hexdigest()[:16] + ".parquet"
        table = pa.Table.from_pylist(fresh, schema=self.schema)
        path = self.parts / name
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        atomic_write_bytes(path, sink.getvalue().to_pybytes())
        self.written.update(seen)
        self.parts_written += 1
        return path

    def write_summary(self, summary: dict) -> pathlib.Path:
        path = self.root / SUMMARY_FILE
        atomic_write_json(path, summary)
        return path


def read_generations(output: str | os.PathLike) -> pa.Table:
    """All rows of a job's output directory as one table."""
    return pq.read_table(pathlib.Path(output) / PARTS_DIR)
