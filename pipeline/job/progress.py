"""Progress of a running job: rows and tokens of this run, logged as rows done / total, tokens/s, MAT."""
from __future__ import annotations

import logging
import math
import time
from collections import defaultdict

log = logging.getLogger("pipeline.job.run")  # progress lines are the job's log lines


class Progress:
    """Counts rows and tokens of this run; logs rows done / total, tokens/s and running MAT."""

    def __init__(self, total: int, skipped: int, todo: int, interval: float):
        self.total, self.skipped, self.todo = total, skipped, todo
        self.done = self.failed = self.tokens = self.steps = 0
        self.by_replicas = 0  # rows that went through a replica (not rejected before generation)
        self.per_corpus: dict = defaultdict(lambda: {"rows": 0, "failed": 0, "tokens": 0, "steps": 0})
        self.interval = interval
        self.t_start = time.perf_counter()
        self.t_gen: float | None = None  # first batch sent
        self._last_log = 0.0
        self.loading = 0  # replicas started, none ready yet: say so instead of a progress line of zeros
        self.t_load: float | None = None

    def add(self, rows: list) -> None:
        """Count output rows (:class:`~pipeline.rows.OutputRow` or :class:`~pipeline.rows.SweepOutputRow`)."""
        for r in rows:
            c = self.per_corpus[getattr(r, "corpus", None) or "(none)"]
            c["rows"] += 1
            if r.error is not None:
                self.failed += 1
                c["failed"] += 1
            else:
                self.done += 1
                self.tokens += r.n_new_tokens
                self.steps += r.steps
                c["tokens"] += r.n_new_tokens
                c["steps"] += r.steps

    @property
    def mat(self) -> float | None:
        return self.tokens / self.steps if self.steps else None

    def starting(self, replicas: int) -> None:
        """Replicas are starting: until the first batch is sent, the line says the model is loading."""
        self.loading, self.t_load = replicas, time.perf_counter()

    def line(self) -> str:
        now = time.perf_counter()
        if self.t_gen is None and self.loading and self.t_load is not None:
            return f"loading the model on {self.loading} replica(s) ... ({now - self.t_load:.0f} s)"
        gen = now - self.t_gen if self.t_gen else 0.0
        finished = self.done + self.failed
        tps = self.tokens / gen if gen > 0 else 0.0
        eta = (self.todo - finished) * gen / finished if finished and gen > 0 else float("nan")
        mat = f"{self.mat:.2f}" if self.mat else "-"
        return (f"rows {self.skipped + finished}/{self.total} (this run {finished}/{self.todo}, "
                f"{self.failed} failed, {self.skipped} already done) | {tps:.1f} tok/s | MAT {mat} | "
                f"generating {gen:.0f} s" + (f", eta {eta:.0f} s" if math.isfinite(eta) else ""))

    def tick(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last_log >= self.interval:
            self._last_log = now
            log.info("%s", self.line())
