"""Rows -> output rows with one engine. No Ray here: replicas wrap this, tests call it directly.

A row is ``{"id", "prompt", "corpus"}`` (``prompt``: text, chat messages or token ids). Each row is
encoded first; a row the engine refuses (too long for the context, no chat template, ...) becomes an
error row and the others go on. If ``Engine.run`` raises on the batch, the rows are retried one
by one so only the failing ones become error rows.
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from .config import GenerationSpec

log = logging.getLogger("pipeline.worker")


def row_seed(base: int, row_id: Any) -> int:
    """The sampling seed of one row: a stable hash of (``--seed``, row id), in [0, 2**63).

    It depends on nothing else (not on shards, batches, actors or retries), so a row's sample is the
    same however the job is split or resumed.
    """
    key = f"{int(base)}\x00{type(row_id).__name__}\x00{row_id}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


def error_row(row_id: Any, error: str, spec: GenerationSpec, corpus: str | None = None,
              n_prompt_tokens: int | None = None) -> dict:
    return {"id": row_id, "generation": None, "finish_reason": None, "n_prompt_tokens": n_prompt_tokens,
            "n_new_tokens": None, "steps": None, "mean_accepted": None, "accepted_lengths": None,
            "retrieval_success": None, "wall_s": None, "method": spec.method, "model": spec.model,
            "error": error, "corpus": corpus}


def _ok_row(row: dict, res, spec: GenerationSpec) -> dict:
    s = res.stats
    return {"id": row["id"], "generation": res.text, "finish_reason": res.finish_reason,
            "n_prompt_tokens": len(res.prompt_token_ids), "n_new_tokens": len(res.token_ids),
            "steps": s["steps"], "mean_accepted": s["mean_accepted"],
            "accepted_lengths": list(s["accepted_lengths"]), "retrieval_success": s["retrieval_success"],
            "wall_s": s["wall_s"], "method": spec.method, "model": spec.model, "error": None,
            "corpus": row.get("corpus")}


class RowGenerator:
    """Generates output rows for batches of input rows with one :class:`logitspec.Engine`."""

    def __init__(self, engine, spec: GenerationSpec, references: dict | None = None):
        self.engine = engine
        self.spec = spec
        self.references = references or {}

    def __call__(self, rows: list[dict]) -> tuple[list[dict], dict]:
        """(output rows in input order, batch stats)."""
        t0 = time.perf_counter()
        spec = self.spec
        out: list[dict | None] = [None] * len(rows)
        todo: list[int] = []
        encoded: list[list[int]] = []
        for i, r in enumerate(rows):
            try:
                encoded.append(self.engine.encode(r["prompt"], apply_chat_template=spec.chat))
                todo.append(i)
            except ValueError as e:
                out[i] = error_row(r["id"], str(e), spec, r.get("corpus"))
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
                        results.append(self._run([rows[i]], [ids]).results[0])
                    except Exception as e1:  # noqa: BLE001
                        results.append(f"{type(e1).__name__}: {e1}")
            for i, ids, res in zip(todo, encoded, results):
                if isinstance(res, str):
                    out[i] = error_row(rows[i]["id"], res, spec, rows[i].get("corpus"), len(ids))
                else:
                    out[i] = _ok_row(rows[i], res, spec)
        stats = {"wall_s": time.perf_counter() - t0, "rows": len(rows), "engine": engine_stats}
        return out, stats  # type: ignore[return-value]

    def _run(self, rows: list[dict], encoded: list[list[int]]):
        """One ``Engine.run`` over the rows: its results (input order) and the batch's engine stats."""
        spec = self.spec
        return self.engine.run(
            encoded, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_p=spec.top_p,
            top_k=spec.top_k, seed=[row_seed(spec.seed, r["id"]) for r in rows], stop=list(spec.stop) or None,
            reference=[self.references.get(r.get("corpus")) if r.get("corpus") is not None else None
                       for r in rows])
