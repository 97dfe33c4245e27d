"""The job's rows: the ids (all the driver keeps of the input), which (id, sample) pairs the output still
lacks, and the stream of rows to generate, read batch by batch from the input.

Planning reads the id (and corpus) column once (:func:`scan_ids`) and checks the ids: nulls, mixed
kinds, duplicates are :class:`ConfigError`. :func:`pending` compares them with the output's keys;
:func:`stream_chunks` then reads the prompts of the rows still to do, a scanner batch at a time, and
finds each row's problem (an error row) with Arrow compute where the column's type allows.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from logitspec.engine.request import Request

from ..errors import ConfigError
from ..io.inputs import PROBLEM, InputSource, is_token_list_type
from ..io.row_checks import REQUEST_KINDS, fits_request_column, row_problem, row_prompt, row_samples_ok
from ..rows import InputRow
from .config import JobConfig


@dataclass
class InputIndex:
    """The input's ids in row order (Arrow, int64 or string), the corpus names its rows use, and, where
    rows say their own sample count (an ``n`` request column), each row's (None: the job's for all)."""

    source: InputSource
    ids: pa.Array  # one contiguous array (slices and takes of a chunked one cost O(chunks) each)
    id_type: pa.DataType
    generated_ids: bool
    corpora: set = field(default_factory=set)
    samples: np.ndarray | None = None  # int64 per row

    def __len__(self) -> int:
        return len(self.ids)

    def sample_counts(self, num_samples: int) -> np.ndarray:
        """int64 per row: its samples (the row's own ``n``, else the job's ``num_samples``)."""
        if self.samples is None:
            return np.full(len(self), num_samples, dtype=np.int64)
        return self.samples

    def total_keys(self, num_samples: int) -> int:
        """The (id, sample) keys the input asks for."""
        return len(self) * num_samples if self.samples is None else int(self.samples.sum())


def scan_ids(source: InputSource, corpus_column: str | None = None, n_column: str | None = None,
             num_samples: int = 1) -> InputIndex:
    """Read the id, corpus and ``n_column`` (rows' own sample counts; null: ``num_samples``) columns
    of every row (nothing else) and check the ids. A row's unusable ``n`` counts one sample: the row's
    error row (:func:`row_requests` names the problem)."""
    id_col = source.roles["id"]
    cols = ([id_col] if source.has_ids else []) + [c for c in (corpus_column, n_column) if c]
    chunks, corpora, counts, n = [], set(), [], 0
    for t in source.batches(cols):
        if source.has_ids:
            chunks.append(t.column(id_col))
        if corpus_column:
            corpora.update(v for v in pc.unique(t.column(corpus_column)).to_pylist() if v is not None)
        if n_column:
            counts += [num_samples if v is None else v if row_samples_ok(v) else 1
                       for v in t.column(n_column).to_pylist()]
        n += t.num_rows
    samples = np.array(counts, dtype=np.int64) if n_column else None
    if not source.has_ids:
        ids = pa.array(np.arange(n, dtype=np.int64))
        return InputIndex(source, ids, pa.int64(), True, corpora, samples)
    return InputIndex(source, *_checked_ids(chunks, id_col), False, corpora, samples)


def _checked_ids(chunks: list, column: str) -> tuple[pa.Array, pa.DataType]:
    kinds = {("int" if pa.types.is_integer(c.type) else "str")
             for c in chunks if not pa.types.is_null(c.type)}
    if len(kinds) > 1:
        raise ConfigError(f"id column {column!r} mixes integers and strings")
    id_type = pa.string() if kinds == {"str"} else pa.int64()
    ids = pa.chunked_array([c.cast(id_type) for c in chunks], type=id_type).combine_chunks()
    if ids.null_count:
        first = int(np.flatnonzero(pc.is_null(ids).to_numpy(zero_copy_only=False))[0])
        raise ConfigError(f"id column {column!r} has a null at row {first}")
    if _has_duplicates(ids):
        counts = pc.value_counts(ids)
        dup = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
        raise ConfigError(f"id column {column!r} has {len(dup)} duplicated value(s), e.g. "
                          f"{', '.join(repr(d) for d in dup.slice(0, 5).to_pylist())}")
    return ids, id_type


def _has_duplicates(ids: pa.Array) -> bool:
    """Integer ids: a sort (several times faster than Arrow's hashing here); strings: Arrow's unique."""
    if pa.types.is_integer(ids.type):
        s = np.sort(ids.to_numpy())
        return bool((s[1:] == s[:-1]).any())
    return len(pc.unique(ids)) != len(ids)


@dataclass
class Pending:
    """What the output still lacks: the rows with a sample to do, and for rows partly done, which samples."""

    todo: np.ndarray  # bool per input row: some sample of it is still to do
    missing: dict  # id -> sorted samples still to do, for rows partly in the output
    done: int  # (id, sample) pairs of this input already in the output
    rows: int  # rows with something to do
    keys: int  # (id, sample) pairs still to do


def input_keys(index: InputIndex, written: pa.Table, num_samples: int) -> pa.Table:
    """The distinct (id, sample) keys of ``written`` that the input asks for (an id of the input, a
    sample below the row's count), with the row's count ``n``."""
    wanted = pa.table({"id": index.ids, "n": pa.array(index.sample_counts(num_samples))})
    keys = written.select(["id", "sample"]).group_by(["id", "sample"]).aggregate([])
    keys = keys.join(wanted, "id", join_type="inner")
    return keys.filter(pc.less(keys.column("sample"), keys.column("n")))


def pending(index: InputIndex, written: pa.Table | None, num_samples: int) -> Pending:
    """Compare the input's (id, sample) keys with the output's (``written``; None: empty output);
    ``num_samples``: each row's samples where the row does not say its own."""
    total = index.total_keys(num_samples)
    if written is None or written.num_rows == 0:
        n = len(index)
        return Pending(np.ones(n, dtype=bool), {}, 0, n, total)
    keys = input_keys(index, written, num_samples)
    per_id = keys.group_by(["id", "n"]).aggregate([("sample", "count")])
    whole = pc.equal(per_id.column("sample_count"), per_id.column("n"))
    full = per_id.filter(whole).column("id")
    todo = ~pc.is_in(index.ids, value_set=full.combine_chunks()).to_numpy(zero_copy_only=False)
    missing: dict = {}
    partial = per_id.filter(pc.invert(whole))
    if partial.num_rows:
        part = keys.filter(pc.is_in(keys.column("id"), value_set=partial.column("id").combine_chunks()))
        for i, s, n in zip(*(part.column(c).to_pylist() for c in ("id", "sample", "n"))):
            missing.setdefault(i, set(range(n))).discard(s)
        missing = {i: sorted(s) for i, s in missing.items()}
    rows = int(todo.sum())
    return Pending(todo, missing, keys.num_rows, rows, total - keys.num_rows)


# ---------------------------------------------------------------------------------------------- rows
def prompt_problems(t: pa.Table, cfg: JobConfig) -> list:
    """Each row's problem (:func:`row_problem`'s message) or None; vectorised for text and token-id
    columns."""
    use_messages = cfg.messages_column is not None
    prompt = t.column(cfg.prompt_column)
    typ = prompt.type
    if (pa.types.is_null(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or is_token_list_type(typ)):
        if pa.types.is_null(typ):
            blank = pa.array([False] * len(prompt))
        elif is_token_list_type(typ):
            blank = pc.equal(pc.list_value_length(prompt), 0)
        else:
            blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(prompt)), 0)
        null_msg = "prompt and messages are both null" if use_messages else "prompt is null"
        blank_msg = pc.if_else(blank, "empty prompt", None)
        problems = pc.if_else(pc.is_null(prompt), null_msg, blank_msg).to_pylist()
    else:  # a column pipeline.io.json_rows could not type more closely (e.g. lists of floats)
        problems = [row_problem(p) for p in prompt.to_pylist()]
    if use_messages:
        for i, m in enumerate(t.column(cfg.messages_column).to_pylist()):
            if m is not None:
                problems[i] = row_problem(None, m, True)
    if PROBLEM in t.column_names:
        problems = [p or q for p, q in zip(t.column(PROBLEM).to_pylist(), problems)]
    if cfg.request_columns:
        problems = [p or q for p, (_, q) in zip(problems, row_requests(t, cfg))]
    return problems


def row_requests(t: pa.Table, cfg: JobConfig) -> list[tuple[Request | None, str | None]]:
    """Per row, its own :class:`Request` from its ``--request-columns`` values (None where they are all
    null: the job's applies) and why they cannot be used (None if they can)."""
    columns = [(c, t.column(c).to_pylist()) for c in cfg.request_columns]
    out = []
    for k in range(t.num_rows):
        given = {c: values[k] for c, values in columns if values[k] is not None}
        if not given:
            out.append((None, None))
        elif bad := [c for c, v in given.items() if not fits_request_column(c, v)]:
            wants = ", ".join(f"{c} must be {REQUEST_KINDS[c]}" for c in bad)
            out.append((None, f"--request-columns: {wants}, got {given}"))
        else:
            try:
                out.append((cfg.request.with_(**given), None))
            except ValueError as e:
                out.append((None, f"--request-columns: {e}"))
    return out


def kept_columns(cfg: JobConfig) -> tuple[str, ...]:
    """The input columns the output rows carry, once planning resolved ``--keep-columns`` to names
    (:func:`pipeline.job.plan.resolve_keep_columns`; ``all`` before that: none yet)."""
    if cfg.keep_columns in ("all", "none", ""):
        return ()
    return tuple(c.strip() for c in cfg.keep_columns.split(",") if c.strip())


@dataclass
class Chunk:
    """Rows of one scanner batch that are still to do: their table, ids (Arrow), problems and sample
    counts."""

    table: pa.Table
    ids: pa.Array
    problems: list
    samples: np.ndarray  # int64 per row


def stream_chunks(index: InputIndex, cfg: JobConfig, todo: np.ndarray) -> Iterator[Chunk]:
    """The rows with ``todo`` set, read from the input in order, one scanner batch at a time."""
    roles = index.source.roles
    cols = [c for c in (roles["id"] if not index.generated_ids else None, cfg.prompt_column,
                        cfg.messages_column, cfg.corpus_column, *cfg.request_columns) if c]
    cols = list(dict.fromkeys(cols + list(kept_columns(cfg))))
    counts = index.sample_counts(cfg.num_samples)
    offset = 0
    for t in index.source.batches(cols):
        n = t.num_rows
        mask = todo[offset:offset + n]
        if mask.all():  # the common case: the whole batch, no copy
            sub, expected, samples = t, index.ids.slice(offset, n), counts[offset:offset + n]
        elif mask.any():
            pos = np.flatnonzero(mask)
            sub, expected = t.take(pa.array(pos)), index.ids.take(pa.array(pos + offset))
            samples = counts[pos + offset]
        else:
            offset += n
            continue
        if not index.generated_ids and not pc.all(pc.equal(sub.column(roles["id"]), expected)).as_py():
            raise RuntimeError(f"the input {index.source.source} changed while the job ran (ids differ)")
        yield Chunk(sub, expected, prompt_problems(sub, cfg), samples)
        offset += n


def count_problems(index: InputIndex, cfg: JobConfig, todo: Pending, examples: int = 10
                   ) -> tuple[int, int, list[dict]]:
    """(rows, keys) still to do that will be error rows without reaching a replica, and the first
    ``examples`` of those rows as ``{"id", "reason"}`` (for ``--dry-run``)."""
    rows = keys = 0
    first: list[dict] = []
    for c in stream_chunks(index, cfg, todo.todo):
        for i, p in enumerate(c.problems):
            if p is not None:
                rows += 1
                rid = c.ids[i].as_py()
                keys += len(todo.missing.get(rid, range(c.samples[i])))
                if len(first) < examples:
                    first.append({"id": rid, "reason": p})
    return rows, keys, first


def chunk_rows(chunk: Chunk, cfg: JobConfig, default_corpus: str | None, missing: dict) -> Iterator[tuple]:
    """``(row, problem)`` per row of a chunk (an :class:`~pipeline.rows.InputRow`; its prompt None if it has
    a problem)."""
    t, use_messages = chunk.table, cfg.messages_column is not None
    prompts = t.column(cfg.prompt_column).to_pylist()
    messages = t.column(cfg.messages_column).to_pylist() if use_messages else [None] * t.num_rows
    corpora = t.column(cfg.corpus_column).to_pylist() if cfg.corpus_column else [default_corpus] * t.num_rows
    requests = [q for q, _ in row_requests(t, cfg)] if cfg.request_columns else [None] * t.num_rows
    for rid, p, m, c, q, n, problem in zip(chunk.ids.to_pylist(), prompts, messages, corpora, requests,
                                           chunk.samples.tolist(), chunk.problems):
        prompt = None if problem else row_prompt(p, m, use_messages)
        yield InputRow(rid, prompt, c, tuple(missing.get(rid, range(n))), q), problem
