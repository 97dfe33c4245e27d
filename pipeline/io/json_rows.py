"""JSON that Arrow's reader cannot type: a column holding values of several kinds (a number among text
prompts), or a top-level ``[...]`` array. Read with ``json`` here instead (JSON lines one line at a time,
an array whole), into the same Arrow batches the other formats give. A value Arrow cannot hold in its
column (by :func:`pipeline.io.inputs.row_problem`'s rules) becomes null, with the reason in a
``__problem__`` column, so the row becomes an error row rather than failing the job.
"""
from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import pyarrow as pa

from ..errors import ConfigError
from .row_checks import row_problem

PROBLEM = "__problem__"  # the column of a batch read here that says why a value could not be typed


def _records(path: pathlib.Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as fh:
        head = fh.read(4096)
        fh.seek(0)
        if head.lstrip().startswith("["):
            try:
                rows = json.load(fh)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON: {e}") from None
            numbered = enumerate(rows, 1)
        else:
            numbered = _lines(fh, path)
        for n, r in numbered:
            if not isinstance(r, dict):
                raise ConfigError(f"{path}: record {n} is a {type(r).__name__}, not a JSON object")
            yield r


def _lines(fh, path: pathlib.Path) -> Iterator[tuple[int, object]]:
    for n, line in enumerate(fh, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON: {e}") from None


def json_names(path: pathlib.Path) -> list[str]:
    """Every key of every record, in order of first appearance (one pass over the file)."""
    names: dict[str, None] = {}
    for r in _records(path):
        names.update(dict.fromkeys(r))
    return list(names)


def _column(values: list) -> tuple[pa.Array, list]:
    """(Arrow array, problem per value): values of a kind Arrow cannot mix in are null with their problem."""
    try:
        return pa.array(values), [None] * len(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    kinds = [type(v) for v in values if v is not None]
    first = kinds[0] if kinds else type(None)
    problems = [None if v is None or type(v) is first else row_problem(v) or
                f"prompt has type {type(v).__name__}; this file's other prompts are {first.__name__}s"
                for v in values]
    return pa.array([v if p is None else None for v, p in zip(values, problems)]), problems


def read_json_rows(path: pathlib.Path, columns: list[str], rows: int,
                   strict: tuple = ()) -> Iterator[pa.Table]:
    """Tables of ``columns`` (and ``__problem__``), ``rows`` records each. A ``strict`` column (the ids)
    of mixed kinds is a ConfigError (ids are checked, never repaired); other columns' odd values are
    problems."""
    chunk: list[dict] = []

    def table() -> pa.Table:
        arrays, problems = {}, [None] * len(chunk)
        for c in columns:
            values = [r.get(c) for r in chunk]
            if c in strict:
                try:
                    arrays[c] = pa.array(values)
                    continue
                except (pa.ArrowInvalid, pa.ArrowTypeError):
                    raise ConfigError(f"id column {c!r} mixes integers and strings (or holds other values) "
                                      f"in {str(path)!r}") from None
            arrays[c], col_problems = _column(values)
            problems = [p or q for p, q in zip(problems, col_problems)]
        return pa.table({**arrays, PROBLEM: pa.array(problems, pa.string())})

    for r in _records(path):
        chunk.append(r)
        if len(chunk) == rows:
            yield table()
            chunk = []
    if chunk:
        yield table()
