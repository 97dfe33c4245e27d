"""The job's input table, read as a stream of Arrow batches (never whole) and checked before any actor starts.

Accepted inputs: a Parquet, Arrow IPC (file or stream), JSON lines / JSON or CSV file; a directory of
such files (read in sorted path order); or a ``datasets`` dataset saved with ``save_to_disk``. Files are
read with ``pyarrow.dataset`` scanners (Arrow IPC streams with Arrow's stream reader, saved datasets
through ``datasets``' memory-mapped table), only the columns asked for, batch by batch. A JSON file
Arrow cannot type (a column holding both strings and numbers, a top-level ``[...]`` array) is read by
:mod:`pipeline.io.json_rows` instead, which marks the values of the wrong type as row problems.

Schema problems (missing column, unusable column type) raise :class:`ConfigError` here; ids are checked
in :mod:`pipeline.job.pending`, problems of single rows become error rows (:func:`row_problem`).
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from ..errors import ConfigError
from .json_rows import PROBLEM, json_names, read_json_rows
from .openai_batch import TYPES as OPENAI_TYPES
from .openai_batch import read_requests
from .row_checks import row_problem, row_prompt  # noqa: F401 - the input's row checks, named here too

if TYPE_CHECKING:  # the job's config is read, never built, here
    from ..job.config import JobConfig

TABLE_SUFFIXES = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".arrows": "arrow",
    ".jsonl": "json", ".ndjson": "json", ".json": "json",
    ".csv": "csv",
}
SCAN_ROWS = 8192  # rows per batch read from the input


# ---------------------------------------------------------------------------------------------- one file
@dataclass
class InputFile:
    """One input file (or a saved dataset): its format, column names and (typed formats) column types."""

    path: pathlib.Path
    # parquet, arrow, arrow-stream, json, json-rows (pipeline.io.json_rows), csv, datasets, openai
    # (pipeline.io.openai_batch)
    fmt: str
    names: list[str]
    types: dict[str, pa.DataType] = field(default_factory=dict)
    split: str | None = None

    def batches(self, columns: list[str], strict: tuple = ()) -> Iterator[pa.Table]:
        """The file's rows in order, ``SCAN_ROWS`` at a time, as tables of ``columns`` (absent ones null);
        ``strict``: columns whose values are never turned into row problems (the ids)."""
        present = [c for c in columns if c in self.names]
        for t in self._read(present, strict):
            for c in columns:
                if c not in t.column_names:
                    t = t.append_column(c, pa.nulls(t.num_rows))
            yield t.select(columns + ([PROBLEM] if PROBLEM in t.column_names else []))

    def _read(self, present: list[str], strict: tuple) -> Iterator[pa.Table]:
        try:
            if self.fmt == "json-rows":
                yield from read_json_rows(self.path, present, SCAN_ROWS, strict)
            elif self.fmt == "openai":
                yield from read_requests(self.path, present, SCAN_ROWS)
            elif self.fmt == "arrow-stream":
                with pa.memory_map(str(self.path)) as src:
                    for b in pa.ipc.open_stream(src):
                        yield pa.Table.from_batches([b]).select(present)
            elif self.fmt == "datasets":
                table = _load_saved_dataset(self.path, self.split).data.table.select(present)
                for b in table.to_batches(max_chunksize=SCAN_ROWS):
                    yield pa.Table.from_batches([b], schema=table.schema)
            elif self.fmt == "json":
                yield from self._read_json(present, strict)
            else:
                for b in _dataset(self.path, self.fmt).to_batches(columns=present, batch_size=SCAN_ROWS):
                    yield pa.Table.from_batches([b])
        except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {str(self.path)!r} as {self.fmt}: {e}") from None


    def _read_json(self, present: list[str], strict: tuple) -> Iterator[pa.Table]:
        """Arrow's JSON reader; from the first block it cannot type on, :mod:`pipeline.io.json_rows`."""
        done = 0
        try:
            for b in _dataset(self.path, "json").to_batches(columns=present, batch_size=SCAN_ROWS):
                done += b.num_rows
                yield pa.Table.from_batches([b])
            return
        except pa.ArrowInvalid:
            self.fmt = "json-rows"  # later passes read it so from the start
        for t in read_json_rows(self.path, present, SCAN_ROWS, strict):
            skip = min(done, t.num_rows)
            done -= skip
            if skip < t.num_rows:
                yield t.slice(skip)


def _dataset(path: pathlib.Path, fmt: str):
    """A ``pyarrow.dataset`` of one file (its scanners read batches in file order)."""
    import pyarrow.dataset as ds

    if fmt == "csv":
        import pyarrow.csv as pcsv

        fmt = ds.CsvFileFormat(convert_options=pcsv.ConvertOptions(strings_can_be_null=False))
    elif fmt == "arrow":
        fmt = "ipc"
    return ds.dataset(str(path), format=fmt)


def _load_saved_dataset(path: pathlib.Path, split: str | None):
    import datasets

    try:
        d = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        raise ConfigError(f"cannot load the saved dataset {str(path)!r}: {e}") from None
    if isinstance(d, datasets.DatasetDict):
        if split is None:
            if len(d) != 1:
                raise ConfigError(f"{str(path)!r} is a DatasetDict with splits {sorted(d)}; pick one with "
                                  f"--split")
            split = next(iter(d))
        if split not in d:
            raise ConfigError(f"split {split!r} not in {str(path)!r} (splits: {sorted(d)})")
        d = d[split]
    return d.flatten_indices() if getattr(d, "_indices", None) is not None else d


def open_file(path: pathlib.Path, split: str | None = None) -> InputFile:
    """Format, names and types of one file, from its schema (Parquet footer, IPC header, first JSON/CSV
    block)."""
    if is_saved_dataset(path):
        d = _load_saved_dataset(path, split)
        return InputFile(path, "datasets", list(d.column_names), {f.name: f.type for f in d.data.schema},
                         split)
    fmt = TABLE_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot read {str(path)!r}: unknown file type (use "
                          f"{', '.join(sorted(TABLE_SUFFIXES))} or a saved datasets directory)")
    if fmt in ("json", "csv"):
        check_utf8(path)
    if fmt == "json" and _starts_with(path, b"["):
        return _json_rows_file(path)
    try:
        schema = _dataset(path, fmt).schema
    except (OSError, pa.ArrowException) as e:
        if fmt == "arrow":
            try:
                with pa.memory_map(str(path)) as src:
                    schema = pa.ipc.open_stream(src).schema
                return InputFile(path, "arrow-stream", list(schema.names), {f.name: f.type for f in schema})
            except (OSError, pa.ArrowException):
                pass
        if fmt == "json" and isinstance(e, pa.ArrowInvalid):
            return _json_rows_file(path)
        raise ConfigError(f"cannot read {str(path)!r} as {fmt}: {e}") from None
    return InputFile(path, fmt, list(schema.names), {f.name: f.type for f in schema})


NEWLINE = b"\n"


def check_utf8(path: pathlib.Path, chunk: int = 1 << 24) -> None:
    """ConfigError naming the line and column (in bytes) of the first byte of ``path`` (a text file) that
    is not UTF-8: Arrow's JSON reader would pass such bytes on silently and its CSV reader type the column
    as binary. One pass over the file in ``chunk``-byte pieces."""
    line, column, carry = 1, 0, b""  # at the start of ``data``: its line and the bytes of it before
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            data = carry + block
            try:
                data.decode("utf-8")
                ok = len(data)
            except UnicodeDecodeError as e:
                if block and e.reason == "unexpected end of data":
                    ok = e.start  # a character cut by the chunk's end: finish it with the next chunk
                else:
                    line, column = _advance(data[:e.start], line, column)
                    raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at byte "
                                      f"{column + 1} of the line); save the file as UTF-8") from None
            line, column = _advance(data[:ok], line, column)
            carry = data[ok:]
            if not block:
                return


def _advance(data: bytes, line: int, column: int) -> tuple[int, int]:
    """(line, bytes of it before the end) after ``data``, from those at its start."""
    breaks = data.count(NEWLINE)
    return line + breaks, (len(data) - data.rfind(NEWLINE) - 1) if breaks else column + len(data)


def _json_rows_file(path: pathlib.Path) -> InputFile:
    return InputFile(path, "json-rows", json_names(path))


def _starts_with(path: pathlib.Path, prefix: bytes) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip().startswith(prefix)


def is_saved_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _files_of(path: pathlib.Path) -> list[pathlib.Path]:
    if path.is_file() or is_saved_dataset(path):
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TABLE_SUFFIXES
                   and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"input directory {str(path)!r} holds no {'/'.join(sorted(set(TABLE_SUFFIXES)))} "
                          f"files")
    return files


# ---------------------------------------------------------------------------------------------- the input
def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def is_token_list_type(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _check_column_type(name: str, role: str, t: pa.DataType) -> None:
    ok = {
        "prompt": _is_text_type(t) or is_token_list_type(t),
        "messages": pa.types.is_null(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t))
                                            and pa.types.is_struct(t.value_type)),
        "corpus": _is_text_type(t) or pa.types.is_dictionary(t),
        "id": pa.types.is_integer(t) or _is_text_type(t),
    }[role]
    if not ok:
        want = {"prompt": "strings (or lists of token ids)", "messages": "lists of {role, content} structs",
                "corpus": "strings", "id": "integers or strings"}[role]
        raise ConfigError(f"column {name!r} (--{role}-column) has type {t}; expected {want}")


@dataclass
class InputSource:
    """The input's files and the roles of their columns; :meth:`batches` streams them in row order."""

    source: str
    files: list[InputFile]
    roles: dict[str, str]  # role (id, prompt, messages, corpus) -> column name
    limit: int | None = None

    @property
    def has_ids(self) -> bool:
        return any(self.roles["id"] in f.names for f in self.files)

    def batches(self, columns: list[str]) -> Iterator[pa.Table]:
        """Tables of ``columns`` (absent ones null) over every file in order, at most ``limit`` rows in
        all."""
        left = self.limit
        for f in self.files:
            for t in f.batches(columns, strict=(self.roles["id"],)):
                if left is not None:
                    if left <= 0:
                        return
                    t = t.slice(0, left)
                    left -= t.num_rows
                yield t


def open_input(cfg: JobConfig) -> InputSource:
    """The files of ``cfg.input`` with their schemas checked (no rows read); ConfigError naming the
    problem."""
    path = pathlib.Path(cfg.input).expanduser()
    if not path.exists():
        raise ConfigError(f"input {cfg.input!r} does not exist")
    roles = {"id": cfg.id_column, "prompt": cfg.prompt_column}
    if cfg.messages_column:
        roles["messages"] = cfg.messages_column
    if cfg.corpus_column:
        roles["corpus"] = cfg.corpus_column
    if cfg.input_format == "openai":  # pipeline.io.openai_batch.as_openai_job made it so
        files = [InputFile(path, "openai", list(OPENAI_TYPES), dict(OPENAI_TYPES))]
    else:
        files = [open_file(f, cfg.split) for f in _files_of(path)]
    for f in files:
        for role, col in roles.items():
            if col in f.types:
                _check_column_type(col, role, f.types[col])
    available = sorted({c for f in files for c in f.names})

    def require(col: str, flag: str) -> None:
        missing = [str(f.path) for f in files if col not in f.names]
        if missing:
            raise ConfigError(f"column {col!r} ({flag}) not found in {missing[0]!r}"
                              f"{f' and {len(missing) - 1} more files' if len(missing) > 1 else ''}; "
                              f"available columns: {', '.join(available)}")

    require(cfg.messages_column or cfg.prompt_column,
            "--messages-column" if cfg.messages_column else "--prompt-column")
    if cfg.corpus_column:
        require(cfg.corpus_column, "--corpus-column")
    for col in cfg.request_columns:
        require(col, "--request-columns")
    source = InputSource(str(path), files, roles, cfg.limit)
    if source.has_ids:
        require(cfg.id_column, "--id-column")
    return source


def read_columns(cfg: JobConfig, columns: list[str]) -> dict[str, list]:
    """Every row's values of ``columns`` as Python lists: for small inputs (tests, the pipeline benchmark)."""
    tables = list(open_input(cfg).batches(columns))
    return {c: [v for t in tables for v in t.column(c).to_pylist()] for c in columns}
