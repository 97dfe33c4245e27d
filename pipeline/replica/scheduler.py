"""Feeding batches of rows to replicas, and surviving replicas that die.

Batches are taken from an iterator as replicas have room for them (the job streams them from its
input), so only the batches in flight and those requeued are held. Each replica gets up to ``depth``
batches in flight (one running, the next already queued in the
actor), so it never waits on the driver. When a replica dies (``RayActorError``: its process was
killed, crashed or lost its node), every batch it had in flight goes back to the front of the queue
and a new replica is started in its place (up to ``max_replacements`` times). A batch that was
running when its replica died twice is split into single rows; a single row that kills its replica
``max_row_attempts`` times becomes an error row.

Which batches were running: in a replica whose tasks run one after another, the oldest in flight; in a
``concurrent`` replica (its tasks share one engine session, :mod:`pipeline.replica.streaming`), every batch in
flight, since any of them may hold the row that killed it. There, a batch that has seen a death and the single
rows split off a batch run alone (nothing else in flight on that replica), so a later death is theirs only: an
innocent row is never made an error row, a crashing one still is. So every row ends up in the output exactly
once, either generated or with the reason it failed; results of a dead replica are never used.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from .history import SharedHistory
from .resources import Replica

log = logging.getLogger("pipeline.replica.scheduler")


class JobFailed(RuntimeError):
    """The job cannot go on (e.g. every replica fails to start)."""


@dataclass
class Batch:
    key: int
    rows: list
    deaths: int = 0  # replicas that died while running this batch
    split: bool = False  # a single row split off a batch that died or raised

    @property
    def alone(self) -> bool:
        """Runs with nothing else in flight on a concurrent replica (a suspect of a death)."""
        return self.split or self.deaths > 0


@dataclass
class _Slot:
    replica: Replica
    started: float
    ready: bool = False
    info: dict = field(default_factory=dict)
    inflight: deque = field(default_factory=deque)  # (ref, Batch), oldest (= running) first
    progress: float = 0.0  # when it last returned a result, or was sent work while idle


@dataclass
class SchedulerStats:
    first_ready_s: float | None = None  # from scheduler start to the first replica ready
    all_ready_s: float | None = None  # ... to every initial replica ready
    first_dispatch: float | None = None  # perf_counter of the first batch sent
    last_result: float | None = None
    replicas_started: int = 0
    replacements: int = 0
    deaths: int = 0
    batches_redone: int = 0
    replica_info: list = field(default_factory=list)  # info dicts of every replica that became ready
    # per death: the replica, its node, the error, the ids of the rows its batches in flight held (redone)
    death_log: list = field(default_factory=list)


class Scheduler:
    def __init__(self, factory: Callable[[str], Replica], n_replicas: int, batches: Iterable[Batch],
                 on_result: Callable[[Batch, list, dict], None],
                 on_failed_rows: Callable[[list, str], None],
                 on_event: Callable[..., None] | None = None, on_tick: Callable[[], None] | None = None,
                 depth: int = 2, max_replacements: int = 5, max_row_attempts: int = 2,
                 tick_s: float = 1.0, history: SharedHistory | None = None,
                 batch_timeout_s: float | None = None, start_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """``history``: the job's shared history (``--share-history``): batches carry other
        replicas' answers to a replica, results bring its answers back. ``batch_timeout_s``: a replica
        with work in flight that returns nothing for this long is given up as lost (killed, its
        batches redone elsewhere); ``start_timeout_s``: so is one not ready this long after it was
        asked for (not placed, or stuck loading). None: no limit. ``clock``: seconds, for every
        duration the scheduler measures (tests give their own)."""
        self.clock = clock
        self.factory = factory
        self.n = n_replicas
        self.queue: deque[Batch] = deque()  # batches to redo (requeued), taken before new ones
        self.source = iter(batches)
        self.source_done = False
        self.on_result = on_result
        self.on_failed_rows = on_failed_rows
        self.on_event = on_event or (lambda *a, **k: None)
        self.on_tick = on_tick or (lambda: None)
        self.depth = depth
        self.max_replacements = max_replacements
        self.max_row_attempts = max_row_attempts
        self.tick_s = tick_s
        self.history = history
        self.batch_timeout_s, self.start_timeout_s = batch_timeout_s, start_timeout_s
        self.slots: dict[str, _Slot] = {}
        self.ready_refs: dict = {}  # ObjectRef -> slot name
        self.task_refs: dict = {}  # ObjectRef -> slot name
        self.stats = SchedulerStats()
        self._next_key = -1  # keys of batches split here: negative (the source's are >= 0)
        self._count = 0
        self._initial_ready = 0
        self._start_failures = 0
        self._last_error = ""
        self._last_stuck_log = 0.0
        # set (e.g. by a signal handler) to stop after the current wait
        self.stop_requested: str | None = None

    # ------------------------------------------------------------------ replicas
    def _start(self) -> None:
        name = f"replica-{self._count}"
        self._count += 1
        rep = self.factory(name)
        self.slots[name] = _Slot(rep, self.clock())
        self.ready_refs[rep.ready()] = name
        self.stats.replicas_started += 1
        self.on_event("start", name=name)

    def _lost(self, name: str, err: BaseException) -> None:
        """A replica died: requeue its batches, replace it."""
        slot = self.slots.pop(name)
        slot.replica.kill()
        self.stats.deaths += 1
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        self._last_error = f"{type(err).__name__}: {first_line}"
        for ref in [r for r, n in self.ready_refs.items() if n == name]:
            del self.ready_refs[ref]
        requeue = []
        concurrent = getattr(slot.replica, "concurrent", False)
        for i, (ref, batch) in enumerate(slot.inflight):
            self.task_refs.pop(ref, None)
            if i == 0 or concurrent:  # tasks run in order: the oldest was the one running; else all were
                batch.deaths += 1
            requeue.append(batch)
        self.stats.batches_redone += len(requeue)
        for batch in reversed(requeue):
            self._requeue(batch)
        node = slot.info.get("node_id")
        redone = [row_id(r) for b in requeue for r in b.rows]
        self.stats.death_log.append({"replica": name, "node_id": node, "error": self._last_error,
                                     "batches_redone": len(requeue), "rows_redone": redone})
        more = f" and {len(redone) - 10} more" if len(redone) > 10 else ""
        shown = ", ".join(map(str, redone[:10])) + more
        log.warning("%s%s died (%s); %d batch(es) go back to the queue%s", name,
                    f" on node {node}" if node else "", self._last_error, len(requeue),
                    f", rows redone: {shown}" if redone else "")
        self.on_event("death", name=name, error=self._last_error, requeued=len(requeue), node_id=node)
        if not slot.ready and getattr(err, "actor_init_failed", True):
            # its __init__ raised (e.g. the model does not fit): a replacement would fail the same way.
            # A process killed while loading (OOM killer, lost node) is replaced like any dead replica.
            self._start_failures += 1
            if self.stats.first_ready_s is None and self._start_failures >= min(2, self.n + 1):
                raise JobFailed(f"replicas fail to start: {err}")
        if self.stats.replacements >= self.max_replacements:
            if not self.slots:
                raise JobFailed(f"every replica died and the replacement budget ({self.max_replacements}) "
                                f"is spent; last error: {self._last_error}")
            log.warning("replacement budget spent; going on with %d replica(s)", len(self.slots))
            return
        if self.has_work() or any(s.inflight for s in self.slots.values()):
            self.stats.replacements += 1
            self._start()

    def _requeue(self, batch: Batch) -> None:
        if batch.deaths >= 2 and len(batch.rows) > 1:
            log.warning("batch %d was running in %d replicas that died; splitting it into single rows",
                        batch.key, batch.deaths)
            for row in reversed(batch.rows):
                self.queue.appendleft(Batch(self._new_key(), [row], split=True))
        elif len(batch.rows) == 1 and batch.deaths >= self.max_row_attempts:
            self.on_failed_rows(batch.rows, f"the worker process died {batch.deaths} times while generating "
                                            f"this row (last: {self._last_error})")
        else:
            self.queue.appendleft(batch)

    def _new_key(self) -> int:
        self._next_key -= 1
        return self._next_key + 1

    def has_work(self) -> bool:
        """Batches left to send: requeued ones, or the source not read to its end (which reads ahead one)."""
        if self.queue:
            return True
        if not self.source_done:
            batch = next(self.source, None)
            if batch is None:
                self.source_done = True
            else:
                self.queue.append(batch)
        return bool(self.queue)

    def _feed(self) -> None:
        for name, slot in self.slots.items():
            while slot.ready and len(slot.inflight) < self.depth and self.has_work():
                if slot.inflight and getattr(slot.replica, "concurrent", False) and (
                        self.queue[0].alone or any(b.alone for _, b in slot.inflight)):
                    break  # a suspect batch runs alone on a concurrent replica
                batch = self.queue.popleft()
                if not slot.inflight:
                    slot.progress = self.clock()
                ref = slot.replica.submit(batch.rows,
                                          self.history.for_replica(name) if self.history else None)
                slot.inflight.append((ref, batch))
                self.task_refs[ref] = name
                if self.stats.first_dispatch is None:
                    self.stats.first_dispatch = self.clock()

    # ------------------------------------------------------------------ main loop
    def run(self) -> SchedulerStats:
        t0 = self.clock()
        for _ in range(self.n):
            self._start()
        while self.task_refs or self.has_work():
            self._feed()
            refs = list(self.ready_refs) + list(self.task_refs)
            if not refs:
                raise JobFailed("no replica is alive or starting")  # pragma: no cover - guarded in _lost
            done, _ = ray.wait(refs, num_returns=1, timeout=self.tick_s)
            for ref in done:
                if ref in self.ready_refs:
                    self._on_ready(ref, t0)
                elif ref in self.task_refs:
                    self._on_task(ref)
            self.on_tick()
            self._check_timeouts()
            self._warn_if_stuck(t0)
            if self.stop_requested:
                raise KeyboardInterrupt(self.stop_requested)
        for slot in self.slots.values():  # replicas still starting are not needed any more
            if not slot.ready:
                slot.replica.kill()
        return self.stats

    def _check_timeouts(self) -> None:
        """Give up on replicas that answer nothing for too long (a hung process, a node that went silent)."""
        now = self.clock()
        for name, slot in list(self.slots.items()):
            node = slot.info.get("node_id")
            where = f" on node {node}" if node else ""
            if slot.ready and slot.inflight and self.batch_timeout_s is not None and \
                    now - slot.progress > self.batch_timeout_s:
                self._lost(name, TimeoutError(f"no result from {name}{where} for {now - slot.progress:.3g} s "
                                              f"(--batch-timeout {self.batch_timeout_s:g})"))
            elif not slot.ready and self.start_timeout_s is not None and \
                    now - slot.started > self.start_timeout_s:
                self._lost(name, TimeoutError(f"{name} not ready {now - slot.started:.3g} s after it was "
                                              f"started (not placed, or stuck loading; --start-timeout "
                                              f"{self.start_timeout_s:g})"))

    def _warn_if_stuck(self, t0: float) -> None:
        """No replica up for a while: warn when some are still waiting to be placed (the cluster lacks the
        resources asked for), not while they load the model (the progress line says so)."""
        now = self.clock()
        if any(s.ready for s in self.slots.values()) or now - t0 < 60 or now - self._last_stuck_log < 60:
            return
        self._last_stuck_log = now
        waiting = unplaced([_loading(s.replica) for s in self.slots.values() if not s.ready])
        if waiting is None:
            return
        log.warning("no replica ready after %.0f s: %s waiting for resources (cluster resources available "
                    "now: %s)", now - t0, waiting, {k: v for k, v in ray.available_resources().items()
                                                    if k in ("CPU", "GPU", "memory")})

    def _on_ready(self, ref, t0: float) -> None:
        name = self.ready_refs.pop(ref)
        try:
            info = ray.get(ref)
        except RayError as e:
            self._lost(name, e)
            return
        slot = self.slots[name]
        slot.ready, slot.info = True, {**info, "name": name, "ready_s": self.clock() - slot.started}
        self.stats.replica_info.append(slot.info)
        now = self.clock() - t0
        if self.stats.first_ready_s is None:
            self.stats.first_ready_s = now
        self._initial_ready += 1
        if self._initial_ready == self.n:
            self.stats.all_ready_s = now
        log.info("%s ready in %.1f s (pid %s on node %s, %s, model load %.1f s)", name, slot.info["ready_s"],
                 info.get("pid"), info.get("node_id"), info.get("device"),
                 info.get("model_load_s", float("nan")))
        self.on_event("ready", name=name, info=slot.info)

    def _on_task(self, ref) -> None:
        name = self.task_refs.pop(ref)
        slot = self.slots[name]
        batch = next(b for r, b in slot.inflight if r == ref)
        try:
            rows, stats = ray.get(ref)
        except RayActorError as e:
            self.task_refs[ref] = name  # _lost drops every ref of the slot, this one included
            self._lost(name, e)
            return
        except (RayTaskError, GetTimeoutError, RayError) as e:
            slot.inflight = deque((r, b) for r, b in slot.inflight if r != ref)
            self._task_error(batch, e)
            return
        slot.inflight = deque((r, b) for r, b in slot.inflight if r != ref)
        self.stats.last_result = slot.progress = self.clock()
        if self.history is not None:
            self.history.collect(name, stats.pop("answers", None))
        self.on_result(batch, rows, stats)
        self.on_event("batch", name=name, batch=batch.key, rows=len(rows), pid=stats.get("pid"))

    def _task_error(self, batch: Batch, err: BaseException) -> None:
        """The batch raised inside a live replica (the worker catches row errors, so this is rare)."""
        msg = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
        log.warning("batch %d raised %s", batch.key, msg)
        if len(batch.rows) > 1:
            for row in reversed(batch.rows):
                self.queue.appendleft(Batch(self._new_key(), [row], split=True))
        else:
            self.on_failed_rows(batch.rows, msg)


def row_id(row):
    """A row's id, for the log and the summary."""
    return getattr(row, "id", row)


def _loading(replica) -> bool | None:
    """Whether a replica's process has started loading the model (None: it cannot tell)."""
    loading = getattr(replica, "loading", None)
    return loading() if loading is not None else None


def unplaced(loading: list[bool | None]) -> str | None:
    """What the start-up warning says of the replicas not ready (``loading``: each one's
    :func:`_loading`), or None when every one is loading the model (nothing to warn about)."""
    if all(x is True for x in loading):
        return None
    known = [x for x in loading if x is not None]
    if len(known) < len(loading):
        return f"{len(loading)} replica(s) (loading or not placed yet)"
    return f"{sum(not x for x in known)} of {len(loading)} replica(s) not placed yet"
