"""Running an evaluation sweep: plan it (no Ray), generate every (row, configuration) through the
batch job's scheduler and replicas, then score and write the report.

Layout of ``--output``: ``rows/`` (a Parquet dataset of :class:`pipeline.rows.SweepOutputRow`, one
row per example and configuration; resumed like a batch job's output), ``report.json``, ``report.md``,
``report.png``. A rerun generates only the (row, configuration) pairs missing from ``rows/``.
"""
from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from logitspec.evaluation import LongBenchFormatError, read_directory
from logitspec.evaluation.sweep_rows import sweep_rows

from ..errors import ConfigError
from ..io.model import check_model
from ..io.output import OutputStore
from ..job.progress import Progress
from ..replica.pool import RunRecord, connect_ray, drive_replicas, replica_resources
from ..rows import SweepInputRow, SweepOutputRow
from .config import EvalConfig
from .generator import row_id, sweep_error_row

log = logging.getLogger("pipeline.sweep.run")
ROWS_DIR = "rows"


@dataclass
class SweepPlan:
    """What a sweep will do: its examples, their prompt rows, the output, and the pairs still to generate."""

    data: dict  # {dataset: [Example]}
    rows: list  # [SweepRow]
    store: OutputStore
    todo: list[SweepInputRow] = field(default_factory=list)  # rows with configurations still to generate
    done_pairs: int = 0
    timing: dict = field(default_factory=dict)


def _model_text(model_path: pathlib.Path, trust_remote_code: bool):
    """The model's tokenizer and its context length, read without loading the weights."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True,
                                              trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    text = config.get_text_config(decoder=True)
    return tokenizer, int(getattr(text, "max_position_embeddings", 1 << 30))


def plan_sweep(cfg: EvalConfig) -> SweepPlan:
    """Read the data, build the prompts, open (lock) the output and decide the pairs to generate;
    :class:`ConfigError` for bad data, model or output before anything starts."""
    t0 = time.perf_counter()
    try:
        data = read_directory(cfg.data, list(cfg.datasets) or None)
    except (LongBenchFormatError, ValueError) as e:
        raise ConfigError(f"--data: {e}") from None
    if cfg.limit:
        data = {name: rows[:cfg.limit] for name, rows in data.items()}
    model_path = check_model(cfg.model, cfg.trust_remote_code)
    tokenizer, max_context = _model_text(model_path, cfg.trust_remote_code)
    chat = cfg.chat == "auto" and bool(getattr(tokenizer, "chat_template", None))
    try:
        rows = sweep_rows(data, tokenizer, max_context, max_new_cap=cfg.max_new_tokens,
                          max_length=cfg.max_length,
                          chat_template=chat)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    store = OutputStore(pathlib.Path(cfg.output) / ROWS_DIR, pa.string(), part_rows=1000, part_seconds=30.0,
                        schema=SweepOutputRow.schema())
    store.prepare(cfg.record(), cfg.overwrite)
    plan = SweepPlan(data, rows, store, timing={"plan_s": time.perf_counter() - t0})
    done = store.keys()  # (id, sample): the sweep writes one sample (0) per row and configuration
    for r in rows:
        missing = [c.name for c in cfg.configs if (row_id(r.key, c.name), 0) not in done]
        plan.done_pairs += len(cfg.configs) - len(missing)
        if missing:
            plan.todo.append(SweepInputRow(r, tuple(missing)))
    return plan


class _Sink:
    """Where the scheduler's rows go: the output store and the progress counters."""

    def __init__(self, cfg: EvalConfig, plan: SweepPlan, progress: Progress, record: RunRecord):
        self.configs = {c.name: c for c in cfg.configs}
        self.store, self.progress, self.record = plan.store, progress, record

    def result(self, batch, rows: list[SweepOutputRow], stats: dict) -> None:
        self.store.add(rows)
        self.progress.add(rows)

    def failed(self, rows: list[SweepInputRow], reason: str) -> None:
        self.result(None, [sweep_error_row(r, self.configs[c], reason) for r in rows for c in r.configs], {})

    def tick(self) -> None:
        if self.progress.t_gen is None and self.record.stats is not None:
            # tokens/s counts from the first batch sent
            self.progress.t_gen = self.record.stats.first_dispatch
        self.store.tick()
        self.progress.tick()


def generate(cfg: EvalConfig, plan: SweepPlan, record: RunRecord, on_event: Callable | None = None) -> None:
    """Ray, the replicas and the scheduler over ``plan.todo`` (batches never mix datasets)."""
    from ..replica.scheduler import Batch
    from .replica import make_eval_replica_factory

    job = cfg.job_config(str(plan.store.root))
    t = time.perf_counter()
    record.ray_info = connect_ray(job)
    plan.timing["ray_init_s"] = time.perf_counter() - t
    resources = replica_resources(job, record.ray_info["started_here"])
    factory = make_eval_replica_factory(cfg, resources)
    size, batches = cfg.rows_per_batch, []
    for name in plan.data:
        rows = [r for r in plan.todo if r.example.dataset == name]
        batches += [Batch(len(batches) + k, rows[s:s + size]) for k, s in enumerate(range(0, len(rows),
                                                                                          size))]
    pairs = sum(len(r.configs) for r in plan.todo)
    progress = Progress(pairs + plan.done_pairs, plan.done_pairs, pairs, cfg.log_interval)
    sink = _Sink(cfg, plan, progress, record)
    log.info("%d replica(s), %s CPU and %d thread(s) each; %d batches of <= %d rows x %d configurations",
             cfg.actors, resources.num_cpus, resources.threads, len(batches), size, len(cfg.configs))
    t = time.perf_counter()
    try:
        drive_replicas(factory, cfg.actors, batches, sink, record, on_event,
                       max_replacements=job.replacements)
    finally:
        plan.timing["generation_s"] = time.perf_counter() - t
        progress.tick(force=True)


def run_sweep(cfg: EvalConfig, on_event: Callable | None = None) -> dict:
    """The whole sweep; returns the report (also written to ``--output``)."""
    from .report import write_report

    t0 = time.perf_counter()
    plan = plan_sweep(cfg)
    log.info("%s: %d rows x %d configurations; %d pairs already in %s, %d rows to generate", cfg.data,
             len(plan.rows), len(cfg.configs), plan.done_pairs, plan.store.root, len(plan.todo))
    record = RunRecord()
    failure: BaseException | None = None
    try:
        if plan.todo:
            generate(cfg, plan, record, on_event)
    except BaseException as e:  # noqa: BLE001 - write what is done, then re-raise
        failure = e
    finally:
        try:
            plan.store.flush()
        except OSError as e:
            failure = failure or e
        if record.ray_info and record.ray_info.get("started_here"):
            import ray

            ray.shutdown()
    try:
        if failure is not None:
            raise failure
        plan.timing["total_s"] = time.perf_counter() - t0
        return write_report(cfg, plan, record)
    finally:
        plan.store.close()

