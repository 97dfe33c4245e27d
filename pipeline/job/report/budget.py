"""What the draft budget did in a finished run: :func:`budget_stats` from its output, for
:func:`~pipeline.replica.budget.budget_sentence`."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from ...replica.budget import break_even_acceptance, budget_sentence
from .data import RunData, group_stats


def budget_stats(data: RunData, t: pa.Table | None = None) -> dict:
    """The statistics :func:`budget_sentence` reads, for the rows ``t`` (default: all) of a run."""
    t = data.table if t is None else t
    s, summ = group_stats(t), data.summary
    gen = (summ.get("config") or {}).get("gen") or {}
    engine = summ.get("engine") or {}
    startup = (summ.get("replicas") or {}).get("startup") or [{}]
    method = data.job.get("method") or gen.get("method")
    if not method and "method" in t.column_names:
        methods = [m for m in pc.unique(t.column("method")).to_pylist() if m]
        method = methods[0] if len(methods) == 1 else None
    return {"method": method, "budget": gen.get("budget"), "decode_steps": s["decode_steps"],
            "verified_steps": s["verified_steps"], "accepted_steps": s["accepted_steps"],
            "mean_accepted": s["mean_accepted"], "retrieval_success": s["retrieval_success"],
            "batch": engine.get("mean_active") or gen.get("max_batch_size"),
            "break_even": engine.get("break_even"), "device": (startup[0] or {}).get("device")}


__all__ = ["break_even_acceptance", "budget_sentence", "budget_stats"]
