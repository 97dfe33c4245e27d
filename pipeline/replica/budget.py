"""What the draft budget decided on one replica, and why, in one log line.

:class:`ReplicaBudget` tallies the replica's finished rows (decode steps, those that verified a draft,
those that accepted one, MAT) and the engine's mean batch; :meth:`ReplicaBudget.stats` adds the
acceptance rate a draft token needs to pay at that batch on this machine, from the engine's policy's
cost curve (:func:`break_even_acceptance`), and :meth:`ReplicaBudget.sentence`
says it as the run report does, e.g. "drafts verified on 12% of steps, accepted on 9% (MAT 1.1): at
batch 8 on this CPU a draft token must be accepted 70% of the time to pay".
"""
from __future__ import annotations

import math
import time

from logitspec.spec_decode.budget import break_even

from ..numbers import pct, sig

LOG_EVERY_S = 60.0  # a replica repeats its line at most this often (its last task's line is the latest)


class ReplicaBudget:
    def __init__(self, method: str | None, device: str | None):
        self.method, self.device = method, device
        self.decode_steps = self.verified_steps = self.accepted_steps = 0
        self.tokens = self.steps = 0
        self.retrieved = 0.0
        self.active_steps = self.batch_steps = 0.0
        self.curve = None
        self.evidence: dict = {}  # the auto budget's evidence (SpeculationPolicy.evidence_summary)
        self.logged_at: float | None = None

    def add(self, rows: list, engine_stats: dict | None = None, engine=None) -> None:
        """Count the generated ``rows`` (output rows; error rows and rows without step statistics are
        skipped) and the engine run's ``engine_stats`` (``mean_active`` over ``batch_steps``)."""
        for r in rows:
            lengths = getattr(r, "accepted_lengths", None)
            if getattr(r, "error", None) or not lengths:
                continue
            decode = len(lengths) - 1
            self.decode_steps += decode
            self.accepted_steps += sum(1 for a in lengths[1:] if a > 1)
            if getattr(r, "verified_steps", None) is not None:
                self.verified_steps += r.verified_steps
            self.tokens += sum(lengths)
            self.steps += len(lengths)
            self.retrieved += (getattr(r, "retrieval_success", None) or 0.0) * decode
        stats = engine_stats or {}
        if stats.get("mean_active") and stats.get("batch_steps"):
            self.active_steps += stats["mean_active"] * stats["batch_steps"]
            self.batch_steps += stats["batch_steps"]
        policy = getattr(engine, "policy", None)
        if getattr(policy, "cost_curve", None) is not None:
            self.curve = policy.cost_curve
        if hasattr(policy, "evidence_summary"):
            self.evidence = policy.evidence_summary(max(1, round(self.batch or 1)))

    @property
    def batch(self) -> float | None:
        return self.active_steps / self.batch_steps if self.batch_steps else None

    def stats(self) -> dict:
        """The statistics :func:`budget_sentence` reads."""
        batch, be = self.batch, None
        if self.curve is not None and batch:
            try:
                be = break_even_acceptance(self.curve, max(1, round(batch)))
            except Exception:  # noqa: BLE001 - a curve that cannot say: the line says less
                be = None
            be = be if be is not None and math.isfinite(be) else None
        d = self.decode_steps
        return {"method": self.method, "decode_steps": d, "verified_steps": self.verified_steps,
                "accepted_steps": self.accepted_steps,
                "mean_accepted": self.tokens / self.steps if self.steps else None,
                "retrieval_success": self.retrieved / d if d else None, "batch": batch, "break_even": be,
                "device": self.device, "evidence": self.evidence}

    def sentence(self) -> str:
        """The budget's line, with the evidence it decided on where the budget is auto."""
        stats = self.stats()
        evidence = evidence_words(stats["evidence"])
        return budget_sentence(stats) + (f"; evidence: {evidence}" if evidence else "")

    def due(self, now: float | None = None) -> bool:
        """True (and noted) when the line is to be logged now: the first time, then every
        :data:`LOG_EVERY_S`."""
        now = time.monotonic() if now is None else now
        if self.logged_at is not None and now - self.logged_at < LOG_EVERY_S:
            return False
        self.logged_at = now
        return True


def break_even_acceptance(curve, batch: int) -> float:
    """The acceptance rate at which one draft token per row pays at ``batch`` rows, from a cost curve
    (:func:`logitspec.spec_decode.budget.break_even`)."""
    return break_even(curve, int(batch))


def evidence_words(evidence: dict) -> str:
    """The auto budget's evidence (:meth:`~logitspec.spec_decode.policy.SpeculationPolicy.evidence_summary`)
    in words: per draft kind the first nodes accepted of those tested, with the 95% upper and lower
    bounds, against the break-even; the rows probed; per batch-size class the tokens/s of steps that
    may draft and of plain steps, and the guard's verdict. Empty without evidence."""
    parts = []
    for kind, e in (evidence.get("first_nodes") or {}).items():
        lo, hi = e["interval"]
        parts.append(f"{kind} first nodes accepted {pct(e['accepted'])} of {e['tested']:g} tested "
                     f"(interval {pct(lo)}-{pct(hi)})")
    be = evidence.get("break_even")
    if parts and be is not None and math.isfinite(be):
        parts[-1] += f" against a break-even of {pct(be)} at {evidence.get('rows', 1)} row(s)"
    if evidence.get("probes"):
        parts.append(f"{evidence['probes']:,} rows probed")
    for rows, c in (evidence.get("speed") or {}).items():
        d, p = c["draft"], c["plain"]
        parts.append(f"from {rows} rows: drafting steps {sig(d['tokens_per_s'])} tok/s ({d['steps']:,}), "
                     f"plain {sig(p['tokens_per_s'])} tok/s ({p['steps']:,}), verdict {c['verdict']}")
    return "; ".join(parts)


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
