"""What the draft budget did, in words: :func:`budget_sentence` from a run's :func:`budget_stats`, and
:func:`break_even_acceptance`, the acceptance rate a draft token needs to pay at a batch size."""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.compute as pc

from .data import RunData, group_stats
from .numbers import pct, sig


def break_even_acceptance(curve, batch: int) -> float:
    """The acceptance rate at which one draft token per row pays at ``batch`` rows, from a cost curve
    (``curve.step(rows, per_row)``: forward seconds, e.g. :class:`logitspec.spec_decode.budget.CostCurve`): a
    2-token forward gives 1 + p tokens where a 1-token one gives 1, so it pays when
    p > step(batch, 2) / step(batch, 1) - 1 (at least 1: no rate pays)."""
    one = curve.step(int(batch), 1)
    return max(0.0, curve.step(int(batch), 2) / one - 1.0) if one > 0 else math.nan


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


def budget_sentence(stats: dict) -> str:
    """What the draft budget did, in one line, from ``stats``: ``method``, ``decode_steps`` (forwards
    after the prefill, summed over rows), ``verified_steps`` (those that verified a draft; None when
    not recorded), ``accepted_steps`` (those that accepted a draft token), ``mean_accepted`` (MAT),
    ``retrieval_success`` (share of decode steps where retrieval found a draft), ``batch`` (rows per
    forward), ``break_even`` (the acceptance rate a draft token needs to pay at that batch, see
    :func:`break_even_acceptance`; None when not recorded) and ``device`` ("cpu", "cuda:0", ...)."""
    mat = stats.get("mean_accepted")
    if stats.get("method") == "ar":
        return f"method ar: plain decoding, no drafts (MAT {sig(mat)})"
    decode = stats.get("decode_steps") or 0
    if not decode:
        return "no decoding step after the prefill: nothing to say about the draft budget"
    verified, accepted = stats.get("verified_steps"), stats.get("accepted_steps")
    retrieval = stats.get("retrieval_success")
    found = f"; retrieval found a draft on {pct(retrieval)} of steps" if retrieval else ""
    if verified == 0 or (verified is None and accepted == 0):
        what = "verified" if verified == 0 else "accepted"
        head = f"decoded plainly: drafts {what} on 0 of {decode:,} steps (MAT {sig(mat)}{found})"
    elif verified is not None:
        head = f"drafts verified on {pct(verified / decode)} of steps"
        if accepted is not None:
            head += f", accepted on {pct(accepted / decode)}"
        head += f" (MAT {sig(mat)})"
    elif accepted is not None:
        head = f"drafts accepted on {pct(accepted / decode)} of steps (MAT {sig(mat)}{found})"
    else:
        head = f"MAT {sig(mat)}{found}"
    batch, be, device = stats.get("batch"), stats.get("break_even"), stats.get("device")
    kind = "GPU" if device and str(device).startswith("cuda") else "CPU" if device else "machine"
    where = f"on this {kind}"
    if batch:
        where = f"at batch {int(batch) if float(batch).is_integer() else sig(batch)} {where}"
    if be is None or (isinstance(be, float) and not math.isfinite(be)):
        return f"{head}, {where}" if batch or device else head
    if be >= 1:
        return (f"{head}: {where} no acceptance rate pays for a draft token (a 2-token forward costs "
                f"{sig(1 + be)}x a 1-token one)")
    return f"{head}: {where} a draft token must be accepted {pct(be)} of the time to pay"
