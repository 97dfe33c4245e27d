"""The rows that travel through the pipeline, typed, and the one place that maps them to Arrow.

- :class:`InputRow`: one input row as a replica's worker sees it (the job's driver reads it from the input);
- :class:`OutputRow`: one sample of the job, generated or failed: a row of the output's Parquet parts;
- :class:`SweepInputRow`: one example of an evaluation sweep with the configurations it still lacks;
- :class:`SweepOutputRow`: one (example, configuration) of a sweep: a row of the sweep's ``rows/`` parts.

Every field of an output row is annotated with its Arrow type (``Annotated[python type, arrow type]``;
the id's type is the input's, given when the schema is made), so the dataclass is the schema:
:meth:`OutputRow.schema`, :meth:`SweepOutputRow.schema`, and :func:`to_table` turns rows into a table.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, get_type_hints

import pyarrow as pa

from logitspec.engine.request import Request
from logitspec.engine.stats import ORIGINS
from logitspec.evaluation.sweep_rows import SweepRow

INPUT_ID = "the input's id type"  # the Arrow type of a job's id column: its input's
# accepted draft tokens by the source that supplied them (logitspec.engine.stats.ORIGINS)
ACCEPTED_FROM = pa.struct([(name, pa.int32()) for name in ORIGINS])


class _Arrow:
    """Arrow schema and dict form of a row dataclass whose fields say their column types."""

    @classmethod
    def schema(cls, id_type: pa.DataType | None = None) -> pa.Schema:
        """The Parquet schema of these rows; ``id_type``: the type of an ``id`` column typed
        :data:`INPUT_ID`."""
        id_type = id_type or pa.string()
        hints = get_type_hints(cls, include_extras=True)
        types = [hints[f.name].__metadata__[0] for f in fields(cls)]
        return pa.schema([(f.name, id_type if t is INPUT_ID else t) for f, t in zip(fields(cls), types)])

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict:
        """The row as a plain dict (the form a Parquet reader gives back)."""
        return {name: getattr(self, name) for name in self.names()}


@dataclass
class InputRow:
    """One input row to generate: ``prompt`` is text, chat messages or token ids; ``samples``: which of
    its samples to generate (all of 0..N-1 but after a resume that lacks some); ``corpus``: the name of
    its reference index, or None; ``request``: this row's own decoding settings, or None for the job's."""

    id: Any
    prompt: Any
    corpus: str | None = None
    samples: tuple[int, ...] = (0,)
    request: Request | None = None


@dataclass
class OutputRow(_Arrow):
    """One sample of one input row: its generation and acceptance statistics, or the error that kept
    it from being generated (``error`` set, the generation fields None)."""

    id: Annotated[Any, INPUT_ID] = None
    sample: Annotated[int, pa.int32()] = 0  # which of the row's --num-samples samples (0 when one per row)
    generation: Annotated[str | None, pa.string()] = None
    finish_reason: Annotated[str | None, pa.string()] = None
    n_prompt_tokens: Annotated[int | None, pa.int32()] = None
    n_new_tokens: Annotated[int | None, pa.int32()] = None
    steps: Annotated[int | None, pa.int32()] = None
    mean_accepted: Annotated[float | None, pa.float64()] = None
    accepted_lengths: Annotated[list[int] | None, pa.list_(pa.int32())] = None
    retrieval_success: Annotated[float | None, pa.float64()] = None
    wall_s: Annotated[float | None, pa.float64()] = None
    method: Annotated[str | None, pa.string()] = None
    model: Annotated[str | None, pa.string()] = None
    error: Annotated[str | None, pa.string()] = None
    corpus: Annotated[str | None, pa.string()] = None
    # accepted draft tokens by the source that supplied them (logitspec.engine.stats.ORIGINS)
    accepted_from: Annotated[dict | None, ACCEPTED_FROM] = None
    # decode steps that verified a drafted token (logitspec.engine.stats: tree size > 0); the rest decoded
    # plainly
    verified_steps: Annotated[int | None, pa.int32()] = None
    # the prompt was cut to fit the context (--truncate left|middle); n_prompt_tokens counts what was kept
    truncated: Annotated[bool | None, pa.bool_()] = None


@dataclass
class SweepInputRow:
    """One example of a sweep (its prompt, token limit, stop rule) and the configurations still to run on
    it."""

    example: SweepRow
    configs: tuple[str, ...]

    @property
    def id(self) -> str:
        """The row as the scheduler and the fault hooks name it."""
        return self.example.key


@dataclass
class SweepOutputRow(_Arrow):
    """One example under one configuration: greedy tokens, timing, or the error."""

    id: Annotated[str, pa.string()] = None  # "<key>|<config>"
    sample: Annotated[int, pa.int32()] = 0  # always 0 (the job's output key is (id, sample))
    key: Annotated[str, pa.string()] = None
    dataset: Annotated[str, pa.string()] = None
    example_id: Annotated[str, pa.string()] = None
    config: Annotated[str, pa.string()] = None
    method: Annotated[str, pa.string()] = None
    generation: Annotated[str | None, pa.string()] = None
    token_ids: Annotated[list[int] | None, pa.list_(pa.int32())] = None
    finish_reason: Annotated[str | None, pa.string()] = None
    n_prompt_tokens: Annotated[int | None, pa.int32()] = None
    n_new_tokens: Annotated[int | None, pa.int32()] = None
    steps: Annotated[int | None, pa.int32()] = None
    mean_accepted: Annotated[float | None, pa.float64()] = None
    prefill_s: Annotated[float | None, pa.float64()] = None
    cached_prompt_tokens: Annotated[int | None, pa.int32()] = None  # prompt tokens from the prefix cache
    row_wall_s: Annotated[float | None, pa.float64()] = None
    run_share_s: Annotated[float | None, pa.float64()] = None
    run_rows: Annotated[int | None, pa.int32()] = None
    peak_rss_bytes: Annotated[int | None, pa.int64()] = None
    truncated: Annotated[bool | None, pa.bool_()] = None
    error: Annotated[str | None, pa.string()] = None
    # the longest time between two of the row's forwards
    max_step_gap_s: Annotated[float | None, pa.float64()] = None


def to_table(rows: list, schema: pa.Schema) -> pa.Table:
    """Output rows (:class:`OutputRow` or :class:`SweepOutputRow`) as a table of ``schema``, column by
    column."""
    return pa.Table.from_pydict({name: [getattr(r, name) for r in rows] for name in schema.names},
                                schema=schema)
