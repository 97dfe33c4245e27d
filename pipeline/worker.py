"""Rows -> output rows with one engine. No Ray here: replicas wrap this, tests call it directly.

A row is ``{"id", "prompt", "corpus", "samples"}`` (``prompt``: text, chat messages or token ids;
``samples``: the sample indexes to generate, ``[0]`` by default); it gives one output row per sample.
Each row is encoded first; a row the engine refuses (too long for the context, no chat template, ...)
becomes error rows and the others go on. If ``Engine.run`` raises on the batch, the rows are retried one
by one so only the failing ones become error rows.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from logitspec.session import sample_seed

from .config import GenerationSpec

log = logging.getLogger("pipeline.worker")


def row_seed(base: int, row_id: Any, sample: int = 0) -> int:
    """The sampling seed of one sample of a row: sample 0 has a stable hash of (``--seed``, row id), in
    [0, 2**63); sample j the engine's :func:`~logitspec.session.sample_seed` of that (so one
    ``Engine.run(..., n=N)`` with the row's seed draws exactly the samples 0..N-1).

    It depends on nothing else (not on shards, batches, actors, retries or ``--num-samples``), so a
    row's sample is the same however the job is split or resumed. Sample 0 keeps the seed rows had
    before samples existed.
    """
    key = f"{int(base)}\x00{type(row_id).__name__}\x00{row_id}".encode()
    return sample_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1, int(sample))


def error_row(row_id: Any, error: str, spec: GenerationSpec, corpus: str | None = None,
              n_prompt_tokens: int | None = None, sample: int = 0) -> dict:
    return {"id": row_id, "sample": sample, "generation": None, "finish_reason": None,
            "n_prompt_tokens": n_prompt_tokens, "n_new_tokens": None, "steps": None, "mean_accepted": None,
            "accepted_lengths": None, "retrieval_success": None, "wall_s": None, "method": spec.method,
            "model": spec.model, "error": error, "corpus": corpus, "accepted_from": None}


def error_rows(row: dict, error: str, spec: GenerationSpec, n_prompt_tokens: int | None = None) -> list[dict]:
    """One error row per sample of ``row``."""
    return [error_row(row["id"], error, spec, row.get("corpus"), n_prompt_tokens, s) for s in samples_of(row)]


def samples_of(row: dict) -> list[int]:
    return list(row.get("samples", (0,)))


def _ok_row(row: dict, sample: int, res, spec: GenerationSpec) -> dict:
    s = res.stats
    return {"id": row["id"], "sample": sample, "generation": res.text, "finish_reason": res.finish_reason,
            "n_prompt_tokens": len(res.prompt_token_ids), "n_new_tokens": len(res.token_ids),
            "steps": s["steps"], "mean_accepted": s["mean_accepted"],
            "accepted_lengths": list(s["accepted_lengths"]), "retrieval_success": s["retrieval_success"],
            "wall_s": s["wall_s"], "method": spec.method, "model": spec.model, "error": None,
            "corpus": row.get("corpus"), "accepted_from": s["accepted_from"]}


class RowGenerator:
    """Generates output rows for batches of input rows with one :class:`logitspec.Engine`."""

    def __init__(self, engine, spec: GenerationSpec, references: dict | None = None):
        self.engine = engine
        self.spec = spec
        self.references = references or {}

    def __call__(self, rows: list[dict]) -> tuple[list[dict], dict]:
        """(output rows: per input row in input order, its samples in order; batch stats)."""
        t0 = time.perf_counter()
        spec = self.spec
        out: list[list[dict]] = [[] for _ in rows]
        todo: list[int] = []
        encoded: list[list[int]] = []
        for i, r in enumerate(rows):
            try:
                encoded.append(self.engine.encode(r["prompt"], apply_chat_template=spec.chat))
                todo.append(i)
            except ValueError as e:
                out[i] = error_rows(r, str(e), spec)
        engine_stats: dict = {}
        if todo:
            try:
                run = self._run([rows[i] for i in todo], encoded)
                results, engine_stats = run.results, dict(run.stats)
            except Exception as e:  # noqa: BLE001 - isolate the row(s) that fail
                log.warning("batch of %d rows failed (%s: %s); retrying them one by one",
                            len(todo), type(e).__name__, e)
                results = []
                for i, ids in zip(todo, encoded):
                    try:
                        results += self._run([rows[i]], [ids]).results
                    except Exception as e1:  # noqa: BLE001
                        results += [f"{type(e1).__name__}: {e1}"] * len(samples_of(rows[i]))
            it = iter(results)
            for i, ids in zip(todo, encoded):
                for s in samples_of(rows[i]):
                    res = next(it)
                    out[i].append(error_row(rows[i]["id"], res, spec, rows[i].get("corpus"), len(ids), s)
                                  if isinstance(res, str) else _ok_row(rows[i], s, res, spec))
        stats = {"wall_s": time.perf_counter() - t0, "rows": len(rows), "engine": engine_stats}
        return [r for rs in out for r in rs], stats

    def _run(self, rows: list[dict], encoded: list[list[int]]):
        """One ``Engine.run`` over every sample of the rows: its results (row by row, samples in order)
        and the batch's engine stats. A row asking for samples 0..N-1 is one prompt with ``n=N`` (one
        prefill shared by its samples); a row asking for other samples (a resume that lacks some) is
        one prompt per sample, each with its own seed (:func:`row_seed`): the same draws either way."""
        spec = self.spec
        prompts, seeds, refs, counts = [], [], [], []
        for r, ids in zip(rows, encoded):
            ref = self.references.get(r.get("corpus")) if r.get("corpus") is not None else None
            samples = samples_of(r)
            groups = [(0, len(samples))] if samples == list(range(len(samples))) else [(s, 1) for s in samples]
            for first, count in groups:
                prompts.append(ids)
                seeds.append(row_seed(spec.seed, r["id"], first))
                refs.append(ref)
                counts.append(count)
        return self.engine.run(
            prompts, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p,
            top_k=spec.top_k, seed=seeds, stop=list(spec.stop) or None, reference=refs, n=counts)
