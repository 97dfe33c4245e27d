"""Tasks of rows -> output rows through ONE engine session, so a replica's slots stay full across tasks.

:class:`StreamingRows` is called like a :class:`~pipeline.replica.worker.RowGenerator` (``rows -> (output
rows, stats)``) but from several threads at once (a Ray threaded actor's concurrent ``generate``
calls). Every call puts its task in an inbox and waits; one of the waiting callers at a time drives
the engine: it encodes new tasks, submits their prompts to a long-lived
:class:`~logitspec.engine.session.Session` whenever it has free slots (oldest task first), steps the session,
routes each finished result to its task, and wakes a task's caller once all its rows are done. So
rows of the next task enter slots freed by the current one instead of waiting for it to drain. No
Ray here.

Outputs are the :class:`RowGenerator`'s for every (id, sample): the same prompts, seeds and ``n=``
grouping (:meth:`RowGenerator.prepare`), and a sequence's tokens depend only on its own seed, not on
the rows sharing its batch. If a session step raises, the session is dropped and the prompts it had
in flight are rerun outside it (:meth:`RowGenerator.recover`: in halves after running out of memory,
else one by one), so only failing prompts become error rows; prompts not yet submitted go to a fresh
session.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..rows import InputRow, OutputRow
from .worker import Prompt, RowGenerator

log = logging.getLogger("pipeline.replica.streaming")

COUNTERS = ("batch_steps", "active_sum", "prefills", "prefill_chunks")


class _Task:
    """One call's rows, their engine prompts and the results gathered so far."""

    def __init__(self, rows: list[InputRow], history: list[list[int]] | None = None):
        self.rows = rows
        self.history = history  # other replicas' answers, added to the engine's history when taken
        self.t0 = time.perf_counter()
        self.out: list[list[OutputRow]] = []  # per row: its error rows if refused at encode
        self.reqs: list[Prompt] = []
        self.results: list[list] = []  # per request: per sample its GenerationResult or error message
        self.submitted = 0  # requests handed to the session so far (in order)
        self.missing = 0  # samples not finished yet
        self.output: tuple[list[OutputRow], dict] | None = None  # set once done
        self.error: BaseException | None = None  # set (with an empty output) if the task itself failed


class StreamingRows:
    """A :class:`RowGenerator`'s engine kept busy across tasks; thread-safe ``__call__(rows)``."""

    def __init__(self, generator: RowGenerator, run=None):
        """``run(fn, *args)``: runs ``fn(*args)`` on the thread that owns the engine and returns its
        result (default: in the calling thread). A replica passes its one engine thread: torch's
        OpenMP pools of several threads compete for the cores (measured: small CPU kernels 1.4-1.8x
        slower, a whole sampled run 1.3x, when a second thread runs torch work after the first)."""
        self.gen = generator
        self._run = run or (lambda fn, *args: fn(*args))
        self.engine = generator.engine
        self._cond = threading.Condition()
        self._inbox: deque[_Task] = deque()  # called, not yet encoded (guarded by _cond)
        self._driving = False  # a caller is driving the engine (guarded by _cond)
        self._tasks: deque[_Task] = deque()  # encoded, not finished; oldest first (driver only)
        self._inflight: dict[int, tuple[_Task, int]] = {}  # session request id -> (task, request index)
        self.session = None
        self._totals = dict.fromkeys(COUNTERS, 0)  # of the sessions dropped so far
        self._reported = dict.fromkeys(COUNTERS, 0)  # counters at the last finished task
        self._reported_oom = 0  # the generator's out-of-memory recoveries at the last finished task

    def __call__(self, rows: list[InputRow], history: list[list[int]] | None = None
                 ) -> tuple[list[OutputRow], dict]:
        """(output rows in input order, each row's samples in order; the task's stats: ``wall_s``,
        ``rows``, ``engine``: the engine's counters since the previous task finished). ``history``:
        as for :meth:`RowGenerator.__call__`, added when the task is taken."""
        return self.wait(self.put(rows, history))

    def put(self, rows: list[InputRow], history: list[list[int]] | None = None) -> _Task:
        """Queue a task of ``rows``; its output comes from :meth:`wait`."""
        task = _Task(rows, history)
        with self._cond:
            self._inbox.append(task)
        return task

    def wait(self, task: _Task) -> tuple[list[OutputRow], dict]:
        """``task``'s output; the caller drives the engine meanwhile unless another caller does."""
        with self._cond:
            while task.output is None and self._driving:
                self._cond.wait()
            if task.output is None:
                self._driving = True
        if task.output is None:
            try:
                self._run(self._drive, task)
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()  # a caller still waiting takes over
        if task.error is not None:
            raise task.error
        return task.output

    # ------------------------------------------------------------------ the driver's loop
    def _drive(self, task: _Task) -> None:
        """Pump until ``task`` is done (other tasks progress meanwhile)."""
        while task.output is None:
            self._pump()

    def _pump(self) -> None:
        """One iteration: take new tasks, fill free slots, one session step, route its results."""
        with self._cond:
            new = list(self._inbox)
            self._inbox.clear()
        for task in new:
            try:
                self.gen.absorb(task.history)
                task.out, task.reqs = self.gen.prepare(task.rows)
            except Exception as e:  # noqa: BLE001 - this task fails (as a RowGenerator call would), not others
                with self._cond:
                    task.error, task.output = e, ([], {})
                    self._cond.notify_all()
                continue
            task.results = [[None] * len(q.samples) for q in task.reqs]
            task.missing = sum(len(q.samples) for q in task.reqs)
            self._tasks.append(task)
        self._submit()
        if self.session is not None and self.session.busy:
            try:
                finished = self.session.step()
            except Exception as e:  # noqa: BLE001 - isolate the prompts that fail
                self._recover(e)
            else:
                for res in finished:
                    task, i = self._inflight[res.request_id]
                    self._put(task, i, res.sample_index, res)
                    if all(x is not None for x in task.results[i]):
                        del self._inflight[res.request_id]
        elif any(t.missing for t in self._tasks) and all(t.submitted == len(t.reqs) for t in self._tasks):
            raise RuntimeError("streaming rows: tasks wait for results no session will produce")  # a bug
        self._finish_done()

    def _submit(self) -> None:
        """Hand waiting prompts to the session while it has free slots, oldest task first."""
        while True:
            task = next((t for t in self._tasks if t.submitted < len(t.reqs)), None)
            if task is None:
                return
            if self.session is None:
                self.session = self.engine.open(self.gen.spec.request)
            if self.session.free_slots <= 0:
                return
            i = task.submitted
            q = task.reqs[i]
            task.submitted += 1
            try:
                rid = self.session.submit(q.ids, q.request, reference=q.ref)
            except ValueError as e:  # refused before any forward: this prompt's samples fail
                for j in range(len(q.samples)):
                    self._put(task, i, j, f"ValueError: {e}")
                continue
            self._inflight[rid] = (task, i)

    def _put(self, task: _Task, i: int, j: int, result) -> None:
        if task.results[i][j] is None:
            task.missing -= 1
        task.results[i][j] = result

    def _recover(self, err: BaseException) -> None:
        """The session raised: drop it and rerun the prompts it had in flight outside it
        (:meth:`RowGenerator.recover`: in halves after running out of memory, else one by one)."""
        reqs = list({(id(t), i): (t, i) for t, i in self._inflight.values()}.values())
        log.warning("engine session failed (%s: %s) with %d prompt(s) in flight",
                    type(err).__name__, err, len(reqs))
        self._drop_session()
        results = self.gen.recover([task.reqs[i] for task, i in reqs], err)
        for (task, i), res in zip(reqs, results):
            for j, x in enumerate(res):
                self._put(task, i, j, x)

    def _drop_session(self) -> None:
        for k, v in self._counters().items():
            self._totals[k] = v
        self.session, self._inflight = None, {}

    def _counters(self) -> dict:
        """The engine's counters over every session of this object so far."""
        if self.session is None:
            return dict(self._totals)
        s = self.session
        now = {"batch_steps": s.steps, "active_sum": s.active_sum, "prefills": s.prefills,
               "prefill_chunks": s.prefill_chunks}
        return {k: self._totals[k] + now[k] for k in COUNTERS}

    def _finish_done(self) -> None:
        """Assemble the tasks whose samples are all in and wake their callers."""
        done = [t for t in self._tasks if t.missing == 0 and t.submitted == len(t.reqs)]
        if not done:
            return
        outputs = []
        for t in done:
            self._tasks.remove(t)
            rows = self.gen.assemble(t.rows, t.out, t.reqs, t.results)
            outputs.append((rows, {"wall_s": time.perf_counter() - t.t0, "rows": len(t.rows), "stream": True,
                                   "engine": self._engine_stats(rows), **self.gen.answers(t.results)}))
        with self._cond:
            for t, output in zip(done, outputs):
                t.output = output
            self._cond.notify_all()

    def _engine_stats(self, rows: list[OutputRow]) -> dict:
        """The engine's counters since the previous finished task (their sum over tasks is the
        replica's total), ``mean_active`` over those steps, the out-of-memory recoveries since, and
        the task's own new tokens."""
        now = self._counters()
        delta = {k: now[k] - self._reported[k] for k in COUNTERS}
        self._reported = now
        oom, self._reported_oom = self.gen.out_of_memory - self._reported_oom, self.gen.out_of_memory
        steps = delta["batch_steps"]
        return {**delta, "mean_active": delta["active_sum"] / steps if steps else 0.0,
                "tokens": sum(r.n_new_tokens or 0 for r in rows), "out_of_memory": oom}
