"""The job's output as an OpenAI Batch API results file (``--output-format openai``).

One line per request of the input whose samples are all in the output, in input order:
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``, the
body a ``chat.completion`` (``/v1/chat/completions``) or ``text_completion`` (``/v1/completions``)
with a choice per sample and ``usage``, plus the request's acceptance statistics under ``logitspec``
(readers that do not know the key skip it). A request with a failed sample is an error line,
``{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}``, as OpenAI's error
file writes them. The Parquet dataset stays the source of truth: the file is rewritten whole from it
at the end of every run (a resumed run's file holds every request done so far).
"""
from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .openai_batch import CHAT

COLUMNS = ("id", "sample", "generation", "finish_reason", "n_prompt_tokens", "n_new_tokens", "steps",
           "mean_accepted", "accepted_lengths", "method", "model", "error", "url", "line")


def _ordered(table: pa.Table, ids: pa.Array, counts: pa.Array) -> pa.Table:
    """``table``'s rows of the input's keys (an input id, a sample below its row's ``counts``), each
    (id, sample) once, in input order then sample."""
    pos = pc.index_in(table.column("id"), value_set=ids)
    table = table.append_column("_pos", pos).filter(pc.is_valid(pos))
    wanted = pc.take(counts, table.column("_pos"))
    table = table.filter(pc.less(table.column("sample"), wanted))
    table = table.sort_by([("_pos", "ascending"), ("sample", "ascending")])
    keys = table.select(["_pos", "sample"])
    repeat = np.zeros(table.num_rows, dtype=bool)  # the same key as the row before: a duplicate
    if table.num_rows > 1:
        p, smp = (keys.column(c).to_numpy() for c in ("_pos", "sample"))
        repeat[1:] = (p[1:] == p[:-1]) & (smp[1:] == smp[:-1])
    return table.filter(pa.array(~repeat)) if repeat.any() else table


def request_line(rows: list[dict], created: int) -> dict:
    """The results line of one request from its output rows (every sample, in order)."""
    first = rows[0]
    custom_id, line = first["id"], first["line"]
    failed = next((r for r in rows if r["error"] is not None), None)
    if failed is not None:
        # a request never tokenized was refused as it stood; one that was, failed in generation
        code = "invalid_request" if failed["n_prompt_tokens"] is None else "generation_failed"
        return {"id": f"batch_req_{line}", "custom_id": custom_id, "response": None,
                "error": {"code": code, "message": failed["error"], "line": line}}
    chat = first["url"] == CHAT
    choices = [{"index": r["sample"], "finish_reason": r["finish_reason"], "logprobs": None,
                **({"message": {"role": "assistant", "content": r["generation"]}} if chat
                   else {"text": r["generation"]})} for r in rows]
    completion = sum(r["n_new_tokens"] for r in rows)
    steps = sum(r["steps"] or 0 for r in rows)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line}",
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": first["model"], "choices": choices,
            "usage": {"prompt_tokens": first["n_prompt_tokens"], "completion_tokens": completion,
                      "total_tokens": first["n_prompt_tokens"] + completion},
            "logitspec": {"method": first["method"], "mean_accepted": completion / steps if steps else None,
                          "steps": steps, "accepted_lengths": [r["accepted_lengths"] for r in rows]}}
    return {"id": f"batch_req_{line}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": f"batch_req_{line}", "body": body}, "error": None}


def write_results(store, index, num_samples: int, path: str | os.PathLike, slice_rows: int = 8192) -> int:
    """Write the results file of every request whose samples are all in ``store``'s output
    (``index``: the input's :class:`~pipeline.job.pending.InputIndex`); returns the lines written. The
    output is sorted as Arrow and turned into lines ``slice_rows`` rows at a time; the file is written
    beside its place and renamed over it (a reader never sees half a file)."""
    path = pathlib.Path(path)
    table = store.read_existing(COLUMNS)
    counts = index.sample_counts(num_samples)
    created = int(time.time())
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        if table is not None:
            table = _ordered(table, index.ids, pa.array(counts))
            group: list[dict] = []
            for start in range(0, table.num_rows, slice_rows):
                for row in table.slice(start, slice_rows).to_pylist():
                    if group and row["id"] != group[0]["id"]:
                        written += _write_request(fh, group, counts, created)
                        group = []
                    group.append(row)
            if group:
                written += _write_request(fh, group, counts, created)
    os.replace(tmp, path)
    return written


def _write_request(fh, group: list[dict], counts: np.ndarray, created: int) -> int:
    """Write ``group`` (one request's rows, ``_pos`` its input row) if it holds every sample the request
    asks for."""
    if len(group) != counts[group[0]["_pos"]]:
        return 0
    fh.write(json.dumps(request_line(group, created), ensure_ascii=False) + "\n")
    return 1
