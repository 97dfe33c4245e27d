"""Running a job: plan it (no Ray), start (or join) Ray, share the indexes, run the replicas with the
scheduler, write the summary.

The stages live in their own modules: :mod:`pipeline.plan` checks the job and finds its rows still to do
before Ray starts (a bad job fails in seconds with a message naming the problem), :mod:`pipeline.rows`
streams their prompts from the input while the job runs, :mod:`pipeline.scheduler` feeds the replicas
and survives their deaths, :mod:`pipeline.summary` builds ``_summary.json``.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pathlib
import signal
import threading
import time
from typing import Callable, Iterator

from .config import ConfigError, JobConfig
from .plan import JobPlan, make_plan
from .progress import Progress
from .rows import chunk_rows, stream_chunks
from .summary import RunRecord, build_summary
from .worker import error_rows

log = logging.getLogger("pipeline.job")

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
FINAL_INFO_TIMEOUT_S = 30.0  # how long the end of a job waits for the replicas' last memory report


# ---------------------------------------------------------------------------------------------- Ray
def connect_ray(cfg: JobConfig) -> dict:
    """Join ``--address`` / ``$RAY_ADDRESS`` (set under ``ray job submit``), else start a local Ray."""
    import ray

    if ray.is_initialized():
        return {"started_here": False, "reused_session": True}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from None
        return {"started_here": False, "address": address}
    # Local Ray: its workers inherit this environment; make this checkout importable in them even
    # when the project is not pip-installed.
    paths = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Ray runs workers at nice 15 by default, below every other process of a shared machine, though
    # the actors do all of this job's work. A local Ray is ours: nice 0 (unless set by the user).
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
    return {"started_here": True, "address": "local"}


def replica_resources(cfg: JobConfig, started_here: bool):
    import ray

    from .resources import ReplicaResources

    total = ray.cluster_resources()
    cpus = cfg.cpus_per_actor
    if cpus is None:
        # a local Ray is ours: share its CPUs among the actors; on a cluster one CPU per actor
        cpus = max(total.get("CPU", 1.0) / (cfg.actors * cfg.tp), 0.01) if started_here else 1.0
        cpus = math.floor(cpus * 100) / 100
    threads = cfg.threads_per_actor or max(1, int(cpus))  # the CPUs Ray reserves for the actor
    if cfg.gpus_per_actor > total.get("GPU", 0.0):
        raise ConfigError(f"--gpus-per-actor {cfg.gpus_per_actor} but the Ray cluster has "
                          f"{total.get('GPU', 0.0):g} GPU(s)")
    if cpus > total.get("CPU", 0.0):
        raise ConfigError(f"--cpus-per-actor {cpus} but the Ray cluster has {total.get('CPU', 0.0):g} CPU(s)")
    if cfg.tp > 1:  # every replica's N shards must fit on one node
        from .tp import check_fits

        check_fits(cfg.actors, cfg.tp, cpus, cfg.gpus_per_actor)
    return ReplicaResources(num_cpus=cpus, num_gpus=cfg.gpus_per_actor, threads=threads)


@contextlib.contextmanager
def stop_on_signals(sched):
    """SIGINT/SIGTERM ask the scheduler to stop after its current (1 s) wait, so the job kills its
    actors and writes a summary. Raising from the handler instead can leave the driver stuck inside
    ``ray.wait`` (seen with Ray 2.60 on Ctrl-C). A second signal exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if sched.stop_requested:
            os._exit(128 + signum)
        sched.stop_requested = f"stopped by {signal.Signals(signum).name}"
        log.warning("%s: stopping after the current wait (again to exit at once); rerun to resume",
                    signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------- the job
def run_job(cfg: JobConfig, on_event: Callable[..., None] | None = None) -> dict:
    """Run the whole job; returns the summary (also written to ``<output>/_summary.json``).

    Raises :class:`ConfigError` before Ray starts if the job cannot run, and
    :class:`pipeline.scheduler.JobFailed` (after writing a summary) if it cannot finish.
    """
    t0 = time.perf_counter()
    plan = make_plan(cfg)
    todo = plan.todo
    progress = Progress(len(plan.data) * cfg.num_samples, todo.done, todo.keys, cfg.log_interval)
    log.info("input %s: %d rows x %d sample(s), %d already in %s, %d to do (%d rows)", plan.data.source.source,
             len(plan.data), cfg.num_samples, todo.done, cfg.output, todo.keys, todo.rows)
    record = RunRecord()
    sink = _Sink(cfg, plan, progress, record)
    failure: BaseException | None = None
    try:
        batches = row_batches(cfg, plan, sink.add)
        first = next(batches, None)  # rows that cannot be generated are written on the way
        if first is not None:  # else no replica is needed
            run_replicas(cfg, plan, sink, itertools.chain([first], batches), on_event, t0)
    except BaseException as e:  # noqa: BLE001 - summarize, then re-raise
        failure = e
    finally:
        failure = flush_rows(plan, failure)
        plan.timing["total_s"] = time.perf_counter() - t0
        progress.tick(force=True)
        summary = build_summary(cfg, plan, progress, record, failure)
        try:
            plan.store.write_summary(summary)
        except OSError as e:  # e.g. the disk is full: the part file's error (if any) is the one to report
            log.error("cannot write the summary: %s", e)
            failure = failure or e
        plan.store.close()
        if record.ray_info and record.ray_info.get("started_here"):
            import ray

            ray.shutdown()
    if failure is not None:
        raise failure
    return summary


def flush_rows(plan: JobPlan, failure: BaseException | None) -> BaseException | None:
    """Write the rows still buffered (also after a stop or failure: they are done); returns the failure."""
    try:
        plan.store.flush()
    except OSError as e:
        log.error("%s", e)
        return failure or e
    return failure


def row_batches(cfg: JobConfig, plan: JobPlan, on_rejected: Callable[[list[dict]], None]) -> Iterator[list[dict]]:
    """The rows still to do, ``cfg.rows_per_batch`` at a time, streamed from the input; the rows found
    unusable on the way (null, empty, wrongly typed prompt ...) go to ``on_rejected`` as error rows."""
    size, batch = cfg.rows_per_batch, []
    for chunk in stream_chunks(plan.data, cfg, plan.todo.todo):
        rejected = []
        for row, problem in chunk_rows(chunk, cfg, plan.default_corpus, plan.todo.missing):
            if problem:
                rejected += error_rows(row, problem, cfg.gen)
                continue
            batch.append(row)
            if len(batch) == size:
                yield batch
                batch = []
        if rejected:
            on_rejected(rejected)
    if batch:
        yield batch


class _Sink:
    """Where finished rows go: the output store (the one writer) and the progress counters."""

    def __init__(self, cfg: JobConfig, plan: JobPlan, progress: Progress, record: RunRecord):
        self.cfg, self.store, self.progress, self.record = cfg, plan.store, progress, record

    def result(self, batch, rows: list[dict], stats: dict) -> None:
        self.add(rows)
        self.progress.by_replicas += len(rows)
        self.record.add_engine(stats.get("engine") or {})

    def failed(self, rows: list[dict], reason: str) -> None:
        self.add([e for r in rows for e in error_rows(r, reason, self.cfg.gen)])
        self.progress.by_replicas += sum(len(r.get("samples", (0,))) for r in rows)

    def tick(self) -> None:
        self._note_start()
        self.store.tick()
        self.progress.tick()

    def add(self, rows: list[dict]) -> None:
        self.store.add(rows)
        self.progress.add(rows)
        self._note_start()

    def _note_start(self) -> None:
        stats = self.record.stats
        if self.progress.t_gen is None and stats is not None and stats.first_dispatch is not None:
            self.progress.t_gen = stats.first_dispatch


def run_replicas(cfg: JobConfig, plan: JobPlan, sink: _Sink, rows: Iterator[list[dict]],
                 on_event: Callable[..., None] | None, t0: float) -> None:
    """Ray, the shared indexes, the replicas: generate ``rows`` (batches); fills the record and timing."""
    import ray

    from .replica import make_replica_factory
    from .scheduler import Batch
    from .shared_history import SharedHistory

    timing, record = plan.timing, sink.record
    t = time.perf_counter()
    record.ray_info = connect_ray(cfg)
    timing["ray_init_s"] = time.perf_counter() - t
    resources = replica_resources(cfg, record.ray_info["started_here"])
    t = time.perf_counter()
    refs = {name: ray.put(arrays) for name, arrays in plan.references.items()}  # once per corpus
    timing["reference_put_s"] = time.perf_counter() - t
    factory = make_replica_factory(cfg.gen, resources, refs, tp=cfg.tp, stream=cfg.stream)
    batches = (Batch(k, b) for k, b in enumerate(rows))
    log.info("starting %d replica(s): %s CPU, %s GPU, %d thread(s) each; batches of <= %d rows",
             cfg.actors, resources.num_cpus, resources.num_gpus, resources.threads, cfg.rows_per_batch)
    history = SharedHistory(cfg.gen.history_tokens) if cfg.gen.share_history else None
    record.shared_history = history.stats if history else None
    t_sched = time.perf_counter()
    try:
        drive_replicas(factory, cfg.actors, batches, sink, record, on_event, history=history,
                       max_replacements=cfg.replacements, max_row_attempts=cfg.max_row_attempts)
    finally:  # also when stopped or failed: the summary says how far start-up and generation got
        stats = record.stats
        if stats is not None:
            timing["replicas_first_ready_s"] = stats.first_ready_s
            timing["replicas_all_ready_s"] = stats.all_ready_s
            if stats.first_dispatch is not None:
                timing["startup_s"] = stats.first_dispatch - t0
                timing["generation_s"] = (stats.last_result or time.perf_counter()) - stats.first_dispatch
        timing["scheduler_s"] = time.perf_counter() - t_sched


def drive_replicas(factory: Callable, actors: int, batches, sink, record: RunRecord, on_event: Callable | None,
                   **scheduler_options) -> None:
    """Run a :class:`~pipeline.scheduler.Scheduler` over ``batches`` with ``actors`` replicas from
    ``factory``, results and failures going to ``sink`` (``result``, ``failed``, ``tick``); stops
    cleanly on SIGINT/SIGTERM, records the scheduler's stats and the replicas' final infos in
    ``record``, and kills every replica it made, also on failure."""
    from .scheduler import Scheduler

    made: list = []

    def tracking_factory(name):
        made.append(factory(name))
        return made[-1]

    sched = Scheduler(tracking_factory, actors, batches, sink.result, sink.failed, on_event=on_event,
                      on_tick=sink.tick, **scheduler_options)
    record.stats = sched.stats
    try:
        with stop_on_signals(sched):
            sched.run()
        record.final = final_infos(sched.slots)
    finally:
        for rep in made:
            rep.kill()


def final_infos(slots: dict, timeout_s: float = FINAL_INFO_TIMEOUT_S) -> list[dict]:
    """The info (memory now) of every replica that is ready, asked after the last row was written.

    Best effort: it describes the run, it decides nothing. A replica that died after its last batch,
    or that does not answer within ``timeout_s``, is reported as ``{"name", "pid", "node_id", "missing":
    why}`` instead of failing a job whose rows are all written."""
    import ray

    asked = []
    for name, slot in slots.items():
        if slot.ready:
            try:
                asked.append((name, slot, slot.replica.info()))
            except Exception as e:  # noqa: BLE001 - a replica whose handle is gone
                asked.append((name, slot, e))
    pending = [ref for _, _, ref in asked if not isinstance(ref, BaseException)]
    if pending:
        ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    out = []
    for name, slot, ref in asked:
        try:
            if isinstance(ref, BaseException):
                raise ref
            out.append({**ray.get(ref, timeout=0), "name": name})
        except Exception as e:  # noqa: BLE001 - dead (RayActorError), or no answer in time (GetTimeoutError)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("%s: no memory report at the end (%s); the summary lists it as not measured", name, why)
            out.append({"name": name, "pid": slot.info.get("pid"), "node_id": slot.info.get("node_id"), "missing": why})
    return out
