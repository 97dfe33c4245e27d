"""Running a job: plan it (no Ray), start (or join) Ray, share the indexes, run the replicas with the
scheduler, write the summary.

The stages live in their own modules: :mod:`pipeline.job.plan` checks the job and finds its rows still to do
before Ray starts (a bad job fails in seconds with a message naming the problem), :mod:`pipeline.job.pending`
streams their prompts from the input while the job runs, :mod:`pipeline.replica.scheduler` feeds the replicas
and survives their deaths, :mod:`pipeline.job.summary` builds ``_summary.json``.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

from ..replica.pool import RunRecord, connect_ray, drive_replicas, replica_resources
from ..replica.worker import error_rows
from ..rows import InputRow, OutputRow
from .config import JobConfig
from .pending import chunk_rows, stream_chunks
from .plan import JobPlan, make_plan
from .progress import Progress
from .report import write_report_quietly
from .summary import build_summary

log = logging.getLogger("pipeline.job.run")


# ---------------------------------------------------------------------------------------------- the job
def run_job(cfg: JobConfig, on_event: Callable[..., None] | None = None) -> dict:
    """Run the whole job; returns the summary (also written to ``<output>/_summary.json``).

    Raises :class:`ConfigError` before Ray starts if the job cannot run, and
    :class:`pipeline.replica.scheduler.JobFailed` (after writing a summary) if it cannot finish.
    """
    t0 = time.perf_counter()
    plan = make_plan(cfg)
    cfg = plan.cfg  # with the resolved model's name and hash (the output's model column)
    todo = plan.todo
    progress = Progress(plan.data.total_keys(cfg.num_samples), todo.done, todo.keys, cfg.log_interval)
    log.info("input %s: %d rows x %d sample(s), %d already in %s, %d to do (%d rows)",
             plan.data.source.source,
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
        results, failure = openai_results(cfg, plan, failure)
        plan.timing["total_s"] = time.perf_counter() - t0
        progress.tick(force=True)
        summary = build_summary(cfg, plan, progress, record, failure)
        if results is not None:
            summary["openai_results"] = results
        try:
            plan.store.write_summary(summary)
        except OSError as e:  # e.g. the disk is full: the part file's error (if any) is the one to report
            log.error("cannot write the summary: %s", e)
            failure = failure or e
        write_report_quietly(plan.store.root)  # _report.md and plots; never the job's failure
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


def openai_results(cfg: JobConfig, plan: JobPlan, failure: BaseException | None
                   ) -> tuple[dict | None, BaseException | None]:
    """``--output-format openai``: the results file rewritten from the output (every request done so
    far, also after a stop); its path and line count, and the failure (a write error if none before)."""
    if cfg.output_format != "openai":
        return None, failure
    from ..io.openai_results import write_results

    try:
        lines = write_results(plan.store, plan.data, cfg.num_samples, cfg.results_path)
    except Exception as e:  # noqa: BLE001 - the run's own failure, if any, stays the one reported
        log.error("cannot write the OpenAI results file %s: %s: %s", cfg.results_path, type(e).__name__, e)
        return None, failure or e
    log.info("wrote %d of %d request(s) to %s", lines, len(plan.data), cfg.results_path)
    return {"path": cfg.results_path, "lines": lines, "requests": len(plan.data)}, failure


def row_batches(cfg: JobConfig, plan: JobPlan, on_rejected: Callable[[list[OutputRow]], None]
                ) -> Iterator[list[InputRow]]:
    """The rows still to do, ``cfg.rows_per_batch`` at a time, streamed from the input; the rows found
    unusable on the way (null, empty, wrongly typed prompt ...) go to ``on_rejected`` as error rows."""
    size, batch = cfg.rows_per_batch, []
    for chunk in stream_chunks(plan.data, cfg, plan.todo.todo):
        plan.store.keep_values(chunk.ids, chunk.table)  # --keep-columns: stays in the driver
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

    def result(self, batch, rows: list[OutputRow], stats: dict) -> None:
        self.add(rows)
        self.progress.by_replicas += len(rows)
        self.record.add_engine(stats.get("engine") or {})
        self.record.add_memory(stats.get("pid"), stats.get("rss_bytes"))

    def failed(self, rows: list[InputRow], reason: str) -> None:
        self.add([e for r in rows for e in error_rows(r, reason, self.cfg.gen)])
        self.progress.by_replicas += sum(len(r.samples) for r in rows)

    def tick(self) -> None:
        self._note_start()
        self.store.tick()
        self.progress.tick()

    def add(self, rows: list[OutputRow]) -> None:
        self.store.add(rows)
        self.progress.add(rows)
        self._note_start()

    def _note_start(self) -> None:
        stats = self.record.stats
        if self.progress.t_gen is None and stats is not None and stats.first_dispatch is not None:
            self.progress.t_gen = stats.first_dispatch


def run_replicas(cfg: JobConfig, plan: JobPlan, sink: _Sink, rows: Iterator[list[InputRow]],
                 on_event: Callable[..., None] | None, t0: float) -> None:
    """Ray, the shared indexes, the replicas: generate ``rows`` (batches); fills the record and timing."""
    import ray

    from ..replica.actor import make_replica_factory
    from ..replica.history import SharedHistory
    from ..replica.scheduler import Batch

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
    sink.progress.starting(cfg.actors)
    history = SharedHistory(cfg.gen.history_tokens) if cfg.gen.share_history else None
    record.shared_history = history.stats if history else None
    t_sched = time.perf_counter()
    try:
        drive_replicas(factory, cfg.actors, batches, sink, record, on_event, history=history,
                       max_replacements=cfg.replacements, max_row_attempts=cfg.max_row_attempts,
                       batch_timeout_s=cfg.batch_timeout_s, start_timeout_s=cfg.start_timeout_s)
    finally:  # also when stopped or failed: the summary says how far start-up and generation got
        stats = record.stats
        if stats is not None:
            timing["replicas_first_ready_s"] = stats.first_ready_s
            timing["replicas_all_ready_s"] = stats.all_ready_s
            if stats.first_dispatch is not None:
                timing["startup_s"] = stats.first_dispatch - t0
                timing["generation_s"] = (stats.last_result or time.perf_counter()) - stats.first_dispatch
        timing["scheduler_s"] = time.perf_counter() - t_sched
