"""The output directory, a Parquet dataset: atomic part files, the job record, the summary, a lock.

Layout of ``--output``::

    part-<hash>.parquet   many rows each (any order): a part per ``part_rows`` rows or ``part_seconds``
    _job.json             the settings the rows were generated with (checked on resume)
    _summary.json         written at the end of a run; removed when a new run starts
    _job.lock             held (flock) by the running job; names its pid and host

Parquet readers (pandas, pyarrow.dataset, Ray Data, DuckDB ``'out/*.parquet'``) skip names starting with ``_``
or ``.``, so ``pd.read_parquet(out)`` reads the rows. Every file is written to a hidden temporary sibling and
renamed into place (after fsync): a visible part file is always complete. The driver is the only writer and
never writes an id twice, so the output holds each input row exactly once per (id, sample); rows it has not
flushed yet are regenerated after a crash. A directory of the earlier layout (``generations/part-*.parquet``,
``job.json``) is moved to this one when a job resumes it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ConfigError
from ..rows import OutputRow, to_table
from .lock import OutputLock

log = logging.getLogger("pipeline.io.output")

JOB_FILE = "_job.json"
SUMMARY_FILE = "_summary.json"
LEGACY_PARTS_DIR, LEGACY_JOB_FILE, LEGACY_SUMMARY_FILE = "generations", "job.json", "summary.json"
PART_GLOB = "part-*.parquet"


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
    """The mode a plain ``open()`` would give a new file (0666 less the umask); ``mkstemp`` makes 0600
    files."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: pathlib.Path, write: Callable[[Any], None]) -> None:
    """``write(binary file)`` into a hidden temporary sibling, fsync, rename to ``path``: all or nothing."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, new_file_mode())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


class OutputStore:
    """Buffers finished rows, writes them as part files and knows which ids the output already holds.

    ``add(rows)`` buffers; a part is written once ``part_rows`` rows are buffered or ``part_seconds``
    have passed since the last one (checked on ``add`` and ``tick``), and by ``flush()`` (end of a run,
    stop). Rows are keyed by (id, sample): ``existing`` holds the keys on disk when the run started (an
    Arrow table), ``written`` the keys this run wrote, ``pending`` the buffered rows; a key in any of
    them is never written again."""

    def __init__(self, root: str | os.PathLike, id_type: pa.DataType, part_rows: int = 10_000,
                 part_seconds: float = 60.0, schema: pa.Schema | None = None, keep: tuple[str, ...] = (),
                 allow_foreign: bool = False):
        """``schema``: the rows' schema (default :meth:`OutputRow.schema` of ``id_type``; the evaluation
        sweep passes :meth:`SweepOutputRow.schema`); ``keep``: input columns each row carries, after the
        schema's (their values given by :meth:`keep_values` before the rows come back); ``allow_foreign``:
        accept a directory that holds files of others (:meth:`foreign_files`), with a warning."""
        self.root = pathlib.Path(root).expanduser()
        self.parts = self.root
        self.schema = OutputRow.schema(id_type) if schema is None else schema
        self.part_rows, self.part_seconds = part_rows, part_seconds
        self.existing: pa.Table | None = None  # (id, sample) of the rows on disk at the start
        self.written: set = set()  # (id, sample) written by this run
        self.pending: dict = {}  # (id, sample) -> row, in arrival order
        self.parts_written = 0
        self._last_flush = time.monotonic()
        self.lock: OutputLock | None = None
        self.keep = tuple(keep)
        self.kept: dict = {}  # id -> its kept input values (a tuple), until its rows are written
        self.keep_types: dict = {}  # kept column -> its Arrow type (the input's)
        self.allow_foreign = allow_foreign

    def keep_values(self, ids: pa.Array, table: pa.Table) -> None:
        """Remember the kept input columns of these rows (``table``'s, row for row with ``ids``)."""
        if not self.keep:
            return
        for c in self.keep:
            if c not in self.keep_types or pa.types.is_null(self.keep_types[c]):
                self.keep_types[c] = table.schema.field(c).type
        columns = [table.column(c).to_pylist() for c in self.keep]
        self.kept.update(zip(ids.to_pylist(), zip(*columns)))

    def close(self) -> None:
        """Release the directory's lock (buffered rows not flushed are dropped: regenerated on resume)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # ------------------------------------------------------------------ start of a run
    def prepare(self, job: dict, overwrite: bool, upgrade: Callable[[dict], dict] | None = None) -> None:
        """Make the directory ready for this run and read the ids already written (``written``).

        ``overwrite`` removes this job's files (parts, job record, summary) and nothing else.
        Otherwise, if rows were written already, the previous run's job record must match ``job``
        (same model, method, sampling ...), or ConfigError: mixing generations made with different
        settings would be silently wrong. ``upgrade(previous record) -> record``: reads a record of an
        earlier version in this one's form (or refuses it). A directory of the earlier layout is moved to
        this one.
        """
        self.check_directory(overwrite)  # before anything is written into it
        self.lock = OutputLock(self.root)  # a second job on this directory stops here
        try:
            self._prepare_locked(job, overwrite, upgrade)
        except BaseException:
            self.close()
            raise

    def _prepare_locked(self, job: dict, overwrite: bool, upgrade: Callable[[dict], dict] | None) -> None:
        if overwrite:
            for f in self.part_files():
                f.unlink()
            for name in (JOB_FILE, SUMMARY_FILE, LEGACY_JOB_FILE, LEGACY_SUMMARY_FILE):
                (self.root / name).unlink(missing_ok=True)
        self._migrate_legacy()
        for tmp in self.root.glob(".*.tmp"):  # a crashed run's unfinished file: never visible, remove it
            tmp.unlink(missing_ok=True)
        job_path = self.root / JOB_FILE
        if job_path.exists() and self.part_files():  # with no rows written yet, the new settings simply apply
            self._check_job(job_path, job, upgrade)
        else:
            atomic_write_json(job_path, job)
        (self.root / SUMMARY_FILE).unlink(missing_ok=True)  # a stale summary must never describe this run
        for f in self.foreign_files():
            log.warning("%s is not a file of this job; it is left alone, but Parquet readers of %s will "
                        "try to read it: move it elsewhere", f, self.root)
        self.existing = self.read_existing(columns=("id", "sample"))

    def _check_job(self, job_path: pathlib.Path, job: dict, upgrade: Callable[[dict], dict] | None) -> None:
        try:
            previous = json.loads(job_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {job_path}: {e}; use --overwrite to start over") from None
        if upgrade is not None:
            previous = upgrade(previous)
        diff = differences(previous, job)
        if diff:
            lines = "; ".join(diff)
            raise ConfigError(f"{self.root} holds output of a job with other settings ({lines}); "
                              f"use --overwrite to start over or choose another --output")

    def _migrate_legacy(self) -> None:
        """Move ``generations/part-*.parquet`` up and ``job.json`` to ``_job.json`` (renames: a crash
        midway leaves files a rerun finds in either place and finishes moving)."""
        legacy = self.root / LEGACY_PARTS_DIR
        if legacy.is_dir():
            for f in sorted(legacy.glob(PART_GLOB)):
                os.replace(f, self.root / f.name)
            for tmp in legacy.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            try:
                legacy.rmdir()
            except OSError:
                log.warning("%s holds files other than part files; left in place", legacy)
        old_job = self.root / LEGACY_JOB_FILE
        if old_job.exists():
            os.replace(old_job, self.root / JOB_FILE)
            log.info("moved %s to the dataset layout (parts in %s, %s)", self.root, self.root, JOB_FILE)
        (self.root / LEGACY_SUMMARY_FILE).unlink(missing_ok=True)
        _fsync_dir(self.root)

    def check_directory(self, overwrite: bool) -> None:
        """Refuse (:class:`ConfigError`, naming the path) an output this job cannot use, before anything is
        written into it: a path that is not a directory or cannot be written, and a ``part-*.parquet``
        that is not a complete part of a job like this one (unreadable, or without the job's columns;
        only file footers are read). With ``overwrite`` an unreadable part is left to be deleted, but a
        readable Parquet file of another kind is still refused: it is not this job's to delete."""
        check_writable(self.root)
        foreign = self.foreign_files()
        if foreign and not self.allow_foreign:
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            names = ", ".join(f.name for f in foreign[:5]) + more
            raise ConfigError(f"{self.root} holds files that are not this job's ({names}): readers of the "
                              f"output dataset would try to read them as rows; move them out, choose another "
                              f"--output, or pass --allow-foreign-files to keep them there")
        for f in self.part_files():
            try:
                names = set(pq.read_schema(f).names)
            except (OSError, pa.ArrowException) as e:
                if overwrite:
                    continue
                raise ConfigError(f"cannot read the existing part file {f}: {e}; it is not a complete part "
                                  f"of this job: delete it or use --overwrite") from None
            lacking = [c for c in self.required_columns() if c not in names]
            if lacking:
                raise ConfigError(f"{f} was not written by this job (no column {', '.join(lacking)}); "
                                  f"move it out of {self.root} or choose another --output")

    def foreign_files(self) -> list[pathlib.Path]:
        """Files and folders in the directory that are not this job's: neither its parts nor its own
        (``_``- or ``.``-named) files, nor the earlier layout's."""
        if not self.root.is_dir():
            return []
        own = (LEGACY_PARTS_DIR, LEGACY_JOB_FILE, LEGACY_SUMMARY_FILE)
        return [f for f in sorted(self.root.iterdir())
                if not f.name.startswith(("_", ".")) and not f.match(PART_GLOB) and f.name not in own]

    def required_columns(self) -> list[str]:
        """Columns every part of this job has held since its first version (``sample``, ``corpus`` and
        ``accepted_from`` came later and are filled in when absent)."""
        return [c for c in ("id", "generation", "error", "n_new_tokens", "steps") if c in self.schema.names]

    def part_files(self) -> list[pathlib.Path]:
        """The part files (also any of the earlier layout not moved yet)."""
        return sorted(self.root.glob(PART_GLOB)) + sorted((self.root / LEGACY_PARTS_DIR).glob(PART_GLOB))

    def inspect(self, job: dict, upgrade: Callable[[dict], dict] | None = None) -> None:
        """What :meth:`prepare` checks and reads (job record, ids written), without writing or locking."""
        self.check_directory(overwrite=False)
        if not self.root.is_dir():
            return
        for name in (JOB_FILE, LEGACY_JOB_FILE):
            if (self.root / name).exists() and self.part_files():
                self._check_job(self.root / name, job, upgrade)
                break
        self.existing = self.read_existing(columns=("id", "sample"))

    def read_existing(self, columns: Iterable[str] = ("id", "sample", "error", "n_new_tokens", "steps",
                                                      "corpus")
                      ) -> pa.Table | None:
        """The given columns of every part file (only those columns are read), or None if none. Parts
        written before the ``sample`` column existed hold sample 0."""
        tables = []
        for f in self.part_files():
            try:
                names = pq.read_schema(f).names
                t = pq.read_table(f, columns=[c for c in columns if c in names])
                if "sample" in columns and "sample" not in names:
                    zeros = pa.array([0] * t.num_rows, pa.int32())
                    t = t.append_column("sample", zeros).select(list(columns))
            except (OSError, pa.ArrowException) as e:
                raise ConfigError(f"cannot read the existing part file {f}: {e}; it is not a complete part "
                                  f"of this job: delete it or use --overwrite") from None
            if t.schema.field("id").type != self.schema.field("id").type:
                raise ConfigError(f"{f} has ids of type {t.schema.field('id').type}, the input's are "
                                  f"{self.schema.field('id').type}; use --overwrite or another --output")
            tables.append(t)
        return pa.concat_tables(tables, promote_options="default") if tables else None

    # ------------------------------------------------------------------ during the run
    def add(self, rows: Iterable) -> pathlib.Path | None:
        """Buffer the rows (:class:`~pipeline.rows.OutputRow` or :class:`~pipeline.rows.SweepOutputRow`)
        whose (id, sample) is neither written nor buffered; write a part if one is due."""
        for r in rows:
            key = (r.id, r.sample)
            if key in self.written or key in self.pending:
                log.warning("row %r sample %d is already in the output; not writing it again", *key)
                continue
            self.pending[key] = r
        return self.tick()

    def tick(self) -> pathlib.Path | None:
        """Write the buffer as a part if it holds ``part_rows`` rows or is ``part_seconds`` old."""
        if self.pending and (len(self.pending) >= self.part_rows
                             or time.monotonic() - self._last_flush >= self.part_seconds):
            return self.flush()
        return None

    def flush(self) -> pathlib.Path | None:
        """Write every buffered row as one part file (atomically); on an error the rows stay buffered."""
        self._last_flush = time.monotonic()
        if not self.pending:
            return None
        self._drop_existing()
        if not self.pending:
            return None
        keys = sorted(f"{i}\x01{s}" for i, s in self.pending)
        name = "part-" + hashlib.sha1("\x00".join(keys).encode()).hexdigest()[:16] + ".parquet"
        table = to_table(list(self.pending.values()), self.schema)
        for k, c in enumerate(self.keep):
            values = [self.kept.get(i, (None,) * len(self.keep))[k] for i, _ in self.pending]
            table = table.append_column(pa.field(c, self.keep_types.get(c, pa.null())),
                                        pa.array(values, self.keep_types.get(c)))
        path = self.root / name
        try:
            atomic_write(path, lambda fh: pq.write_table(table, fh))
        except OSError as e:
            raise OSError(e.errno, f"cannot write the part file {path} ({len(self.pending)} rows; no partial "
                                   f"file is left, a rerun generates them again): {e.strerror or e}") from e
        self.written.update(self.pending)
        for i, _ in self.pending:
            self.kept.pop(i, None)
        self.pending = {}
        self.parts_written += 1
        return path

    def _drop_existing(self) -> None:
        """Drop buffered rows whose key was on disk when the run started (the plan never sends them)."""
        if self.existing is None or not self.existing.num_rows:
            return
        ids = pa.array([i for i, _ in self.pending], self.schema.field("id").type)
        maybe = pc.is_in(ids, value_set=self.existing.column("id").combine_chunks()).to_pylist()
        if not any(maybe):
            return
        old = set(zip(self.existing.column("id").to_pylist(), self.existing.column("sample").to_pylist()))
        for key, m in zip(list(self.pending), maybe):
            if m and key in old:
                log.warning("row %r sample %d is already in the output; not writing it again", *key)
                del self.pending[key]

    def keys(self) -> set:
        """Every (id, sample) on disk (read from the part files; for tests and checks)."""
        t = self.read_existing(columns=("id", "sample"))
        if t is None:
            return set()
        return set(zip(t.column("id").to_pylist(), t.column("sample").to_pylist()))

    def write(self, rows: list) -> pathlib.Path | None:
        """Buffer the rows and write everything buffered now."""
        self.add(rows)
        return self.flush()

    def write_summary(self, summary: dict) -> pathlib.Path:
        """``_summary.json``, its floats rounded to 3 significant digits (for people; the figures are
        measurements, not more precise than that)."""
        path = self.root / SUMMARY_FILE
        atomic_write_json(path, rounded(summary))
        return path


def rounded(obj, digits: int = 3):
    """``obj`` with every float rounded to ``digits`` significant digits (ints, e.g. bytes, as they are)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def check_writable(root: pathlib.Path) -> None:
    """:class:`ConfigError` unless ``root`` is a writable directory or can be made one."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--output {str(root)!r} exists and is not a directory")
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--output {str(root)!r} cannot be made: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {str(root)!r} is not writable ({existing}: permission denied)")


def differences(previous: dict, now: dict, prefix: str = "") -> list[str]:
    """``"key: was A, now B"`` for every setting of ``now`` that ``previous`` holds otherwise; nested
    settings (the request) by their own names (``request.temperature: was 0.8, now 0.0``)."""
    out = []
    for k, v in now.items():
        was = previous.get(k)
        if was == v:
            continue
        if isinstance(v, dict) and isinstance(was, dict):
            out += differences(was, v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}: was {was!r}, now {v!r}")
    return out


def read_generations(output: str | os.PathLike) -> pa.Table:
    """All rows of a job's output directory as one table (either layout)."""
    root = pathlib.Path(output)
    files = sorted(root.glob(PART_GLOB)) + sorted((root / LEGACY_PARTS_DIR).glob(PART_GLOB))
    if not files:
        return OutputRow.schema(pa.int64()).empty_table()
    return pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
