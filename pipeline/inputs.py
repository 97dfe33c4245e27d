"""Reading the job's input table and checking it before any actor starts.

Accepted inputs: a Parquet, Arrow IPC (file or stream), JSONL/JSON or CSV file; a directory of such
files (read in sorted path order); or a ``datasets`` dataset saved with ``save_to_disk``. Only the
columns the job uses are read. Schema problems (missing column, unusable column type, null or
duplicate ids) raise :class:`ConfigError`; problems of single rows (null, empty or wrongly typed
prompt, malformed messages) are found by :func:`row_problem` and become error rows.
"""
from __future__ import annotations

import json
import pathlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .config import ConfigError, JobConfig

TABLE_SUFFIXES = {
    ".parquet": "parquet", ".pq": "parquet",
    ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow", ".arrows": "arrow",
    ".jsonl": "json", ".ndjson": "json", ".json": "json",
    ".csv": "csv",
}


@dataclass
class InputRows:
    """The job's rows, as Python values of the columns it uses (one entry per input row)."""

    ids: list
    id_type: pa.DataType  # int64 or string: the output's id column keeps the input's kind
    prompts: list | None
    messages: list | None
    corpora: list | None
    source: str
    generated_ids: bool = False

    def __len__(self) -> int:
        return len(self.ids)


# ---------------------------------------------------------------------------------------------- readers
def is_saved_dataset(path: pathlib.Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _files_of(path: pathlib.Path) -> list[pathlib.Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TABLE_SUFFIXES
                   and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"input directory {str(path)!r} holds no {'/'.join(sorted(set(TABLE_SUFFIXES)))} files")
    return files


def _read_arrow(path: pathlib.Path) -> pa.Table:
    try:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_file(src).read_all()
    except pa.ArrowInvalid:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_stream(src).read_all()


def _read_json_rows(path: pathlib.Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON: {e}") from None
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise ConfigError(f"{path}: record {n} is a {type(r).__name__}, not a JSON object")
    return rows


def _columns_from_table(table: pa.Table, wanted: list[str]) -> dict[str, list]:
    return {c: table.column(c).to_pylist() for c in wanted if c in table.column_names}


def read_table_file(path: pathlib.Path, wanted: list[str]):
    """(all column names, {wanted column: values}, {column: arrow type (typed formats only)}, rows)."""
    fmt = TABLE_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot read {str(path)!r}: unknown file type (use "
                          f"{', '.join(sorted(TABLE_SUFFIXES))} or a saved datasets directory)")
    try:
        if fmt == "json":
            rows = _read_json_rows(path)
            names: list[str] = []
            for r in rows:
                names.extend(k for k in r if k not in names)
            return names, {c: [r.get(c) for r in rows] for c in wanted if c in names}, {}, len(rows)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            schema = pq.read_schema(path)
            cols = [c for c in wanted if c in schema.names]
            table = pq.read_table(path, columns=cols)
        elif fmt == "arrow":
            table = _read_arrow(path)
        else:
            import pyarrow.csv as pcsv

            table = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(strings_can_be_null=False))
    except ConfigError:
        raise
    except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {str(path)!r} as {fmt}: {e}") from None
    if fmt == "parquet":
        names, types = list(schema.names), {f.name: f.type for f in schema}
    else:
        names, types = list(table.column_names), {f.name: f.type for f in table.schema}
    return names, _columns_from_table(table, wanted), types, table.num_rows


def read_dataset(path: pathlib.Path, wanted: list[str], split: str | None):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds
        raise ConfigError(f"cannot load the saved dataset {str(path)!r}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1:
                raise ConfigError(f"{str(path)!r} is a DatasetDict with splits {sorted(ds)}; pick one with --split")
            split = next(iter(ds))
        if split not in ds:
            raise ConfigError(f"split {split!r} not in {str(path)!r} (splits: {sorted(ds)})")
        ds = ds[split]
    names = list(ds.column_names)
    cols = [c for c in wanted if c in names]
    types = {f.name: f.type for f in ds.data.schema}
    values = ds.select_columns(cols).to_dict() if cols else {}
    return names, values, types, len(ds)


# ---------------------------------------------------------------------------------------------- checks
def _is_text_type(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _is_token_list_type(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _check_column_type(name: str, role: str, t: pa.DataType) -> None:
    ok = {
        "prompt": _is_text_type(t) or _is_token_list_type(t),
        "messages": pa.types.is_null(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t))
                                            and pa.types.is_struct(t.value_type)),
        "corpus": _is_text_type(t) or pa.types.is_dictionary(t),
        "id": pa.types.is_integer(t) or _is_text_type(t),
    }[role]
    if not ok:
        want = {"prompt": "strings (or lists of token ids)", "messages": "lists of {role, content} structs",
                "corpus": "strings", "id": "integers or strings"}[role]
        raise ConfigError(f"column {name!r} (--{role}-column) has type {t}; expected {want}")


def load_input(cfg: JobConfig) -> InputRows:
    """Read and check ``cfg.input``; raises :class:`ConfigError` naming the problem."""
    path = pathlib.Path(cfg.input).expanduser()
    if not path.exists():
        raise ConfigError(f"input {cfg.input!r} does not exist")
    roles = {"id": cfg.id_column, "prompt": cfg.prompt_column}
    if cfg.messages_column:
        roles["messages"] = cfg.messages_column
    if cfg.corpus_column:
        roles["corpus"] = cfg.corpus_column
    wanted = list(dict.fromkeys(roles.values()))

    parts = []
    if is_saved_dataset(path):
        parts.append((str(path), *read_dataset(path, wanted, cfg.split)))
    else:
        for f in _files_of(path):
            parts.append((str(f), *read_table_file(f, wanted)))

    values: dict[str, list] = {c: [] for c in wanted}
    present_everywhere = {c: True for c in wanted}
    for src, names, vals, types, n in parts:
        for role, col in roles.items():
            if col in types:
                _check_column_type(col, role, types[col])
        for c in wanted:
            if c in vals:
                values[c].extend(vals[c])
            else:
                present_everywhere[c] = False
                values[c].extend([None] * n)
    available = sorted({c for _, names, *_ in parts for c in names})

    def require(col: str, flag: str) -> None:
        if not present_everywhere[col]:
            missing = [src for src, names, *_ in parts if col not in names]
            raise ConfigError(f"column {col!r} ({flag}) not found in {missing[0]!r}"
                              f"{f' and {len(missing) - 1} more files' if len(missing) > 1 else ''}; "
                              f"available columns: {', '.join(available)}")

    if cfg.messages_column:
        require(cfg.messages_column, "--messages-column")
    else:
        require(cfg.prompt_column, "--prompt-column")
    if cfg.corpus_column:
        require(cfg.corpus_column, "--corpus-column")

    n_rows = sum(p[-1] for p in parts)
    generated = not any(cfg.id_column in names for _, names, *_ in parts)
    if generated:
        ids: list = list(range(n_rows))
    else:
        require(cfg.id_column, "--id-column")
        ids = values[cfg.id_column]
    limit = cfg.limit if cfg.limit is not None else n_rows
    ids = ids[:limit]
    id_type = _check_ids(ids, cfg.id_column)

    def col(c: str | None) -> list | None:
        return values[c][:limit] if c and present_everywhere.get(c) else None

    prompts = col(cfg.prompt_column)
    corpora = col(cfg.corpus_column)
    if corpora is not None:
        bad = [(i, v) for i, v in enumerate(corpora) if v is not None and not isinstance(v, str)]
        if bad:
            raise ConfigError(f"column {cfg.corpus_column!r} (--corpus-column) must hold strings or nulls; "
                              f"row {bad[0][0]} holds {bad[0][1]!r}")
    return InputRows(ids=ids, id_type=id_type, prompts=prompts, messages=col(cfg.messages_column),
                     corpora=corpora, source=str(path), generated_ids=generated)


def _check_ids(ids: list, column: str) -> pa.DataType:
    kinds = set()
    for i, v in enumerate(ids):
        if v is None:
            raise ConfigError(f"id column {column!r} has a null at row {i}")
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ConfigError(f"id column {column!r} must hold integers or strings; row {i} holds {v!r}")
        kinds.add(int if isinstance(v, int) else str)
    if len(kinds) > 1:
        raise ConfigError(f"id column {column!r} mixes integers and strings")
    dup = [k for k, c in Counter(ids).items() if c > 1]
    if dup:
        raise ConfigError(f"id column {column!r} has {len(dup)} duplicated value(s), e.g. "
                          f"{', '.join(repr(d) for d in dup[:5])}")
    return pa.string() if kinds == {str} else pa.int64()


def row_problem(prompt: Any, messages: Any = None, use_messages: bool = False) -> str | None:
    """Why this row cannot be generated (checked in the driver, no tokenizer needed), or None."""
    if use_messages and messages is not None:
        if not isinstance(messages, list) or not messages:
            return "messages must be a non-empty list of {role, content} objects"
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"malformed message {m!r}: need {{'role': str, 'content': str}}"
        return None
    if prompt is None:
        return "prompt is null" if not use_messages else "prompt and messages are both null"
    if isinstance(prompt, str):
        return "empty prompt" if not prompt.strip() else None
    if isinstance(prompt, list):
        if not prompt:
            return "empty prompt"
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None
        return "a list prompt must hold token ids (integers)"
    return f"prompt has type {type(prompt).__name__}; expected a string (or a list of token ids)"


def row_prompt(prompt: Any, messages: Any, use_messages: bool) -> Any:
    """What the engine encodes for a row that passed :func:`row_problem`."""
    return messages if use_messages and messages is not None else prompt
