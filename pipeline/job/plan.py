"""Planning a job, before Ray starts: read and check the input's ids, check the model, build the
reference indexes, open the output, and find which (id, sample) pairs the output still lacks.

Everything that can be wrong with the flags, the input's schema and ids, the model or the references is
found here, so a bad job fails in seconds with a message naming the problem (:class:`ConfigError`).
The prompts are not read here: :mod:`pipeline.job.pending` streams them while the job runs.
"""
from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
from dataclasses import dataclass, field

from logitspec.engine.request import Request

from ..errors import ConfigError
from ..io.inputs import open_input
from ..io.model import check_chat, check_model, model_label
from ..io.openai_batch import as_openai_job
from ..io.output import OutputStore
from ..rows import OutputRow
from .config import JobConfig
from .pending import InputIndex, Pending, count_problems, kept_columns, pending, scan_ids

log = logging.getLogger("pipeline.job.plan")


@dataclass
class JobPlan:
    """What a job will do: its input's ids, model, indexes and output, and the keys still to do."""

    data: InputIndex
    model_path: pathlib.Path
    references: dict  # corpus name -> index arrays (with their metadata), ready for the object store
    store: OutputStore
    todo: Pending
    default_corpus: str | None = None  # the corpus of rows without a corpus column (the one --reference)
    timing: dict = field(default_factory=dict)  # validate_s, reference_build_s
    cfg: JobConfig | None = None  # the job's config as planned (its model_label set): what the run uses


def job_record(cfg: JobConfig) -> dict:
    """Settings that decide a row's output; a resumed run must use the same ones. The request without
    its ``n``: raising ``--num-samples`` on resume adds the missing samples."""
    g = cfg.gen
    return {"model": g.model, "method": g.method, "request": record_request(g.request), "chat": g.chat,
            "chat_template": g.chat_template, "truncate": g.truncate,
            "dtype": g.dtype, "id_column": cfg.id_column, "prompt_column": cfg.prompt_column,
            "messages_column": cfg.messages_column, "corpus_column": cfg.corpus_column,
            "request_columns": list(cfg.request_columns),
            "references": {n: p for n, p in cfg.references}}


def record_request(request: Request) -> dict:
    """A request as ``_job.json`` holds it: its fields but ``n``."""
    return {k: v for k, v in request.to_dict().items() if k != "n"}


LEGACY_REQUEST_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def upgrade_record(previous: dict) -> dict:
    """A ``_job.json`` of this version from one written before the request had a type (its decoding
    settings as loose fields) or before ``--request-columns``, so that such an output still resumes."""
    # written before rows could carry settings (none did) or before --truncate (long prompts were errors)
    # or before --chat-template (the tokenizer's own template was the only one)
    previous = {"request_columns": [], "truncate": "error", "chat_template": None, **previous}
    if "request" in previous or not all(k in previous for k in LEGACY_REQUEST_FIELDS):
        return previous
    loose = {k: previous[k] for k in LEGACY_REQUEST_FIELDS}
    try:
        request = Request.from_dict(loose)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the output's _job.json holds decoding settings this version cannot read "
                          f"({loose}: "
                          f"{e}); use --overwrite to start over or choose another --output") from None
    rest = {k: v for k, v in previous.items() if k not in LEGACY_REQUEST_FIELDS}
    return {**rest, "request": record_request(request)}


def check_corpora(cfg: JobConfig, data: InputIndex) -> str | None:
    """Check the corpus names the rows use against --reference; the corpus of rows without that column."""
    names = [n for n, _ in cfg.references]
    if not cfg.corpus_column:
        return names[0] if names else None
    unused = [n for n in names if n not in data.corpora]
    if unused:
        raise ConfigError(f"--reference {unused[0]!r} names no corpus in column {cfg.corpus_column!r} "
                          f"(values: {', '.join(sorted(map(str, data.corpora))[:10]) or 'none'})")
    missing = sorted(data.corpora - set(names))
    if names and missing:
        log.warning("rows of corpus %s have no --reference; they draft from their own context only",
                    ", ".join(map(str, missing[:10])))
    return None


def build_references(references, gen, model_path: pathlib.Path) -> dict:
    """``{name: index arrays}`` of every ``(name, path)`` of ``references`` (``--reference``), tokenized
    with the model's tokenizer; ``gen``: the :class:`~pipeline.spec.GenerationSpec`."""
    if not references:
        return {}
    from transformers import AutoTokenizer

    from ..io.reference import prepare_reference

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True,
                                                  trust_remote_code=gen.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"--reference needs the model's tokenizer; cannot load it from {model_path}: "
                          f"{e}") from None
    built = {}
    for name, spec in references:
        built[name] = prepare_reference(name, spec, tokenizer, gen.engine.max_ngram,
                                        datastore=gen.method == "rest")  # REST reads a datastore
        log.info("reference %r: %s", name, bytes(built[name]["__meta__"]).decode()[:300])
    return built


def resolve_keep_columns(cfg: JobConfig, data: InputIndex) -> JobConfig:
    """``cfg`` with ``--keep-columns`` as the input columns it names (``all``: every column but the id and
    any named like an output column); :class:`ConfigError` naming a column that is not in the input or
    that an output column has."""
    names = list(dict.fromkeys(n for f in data.source.files for n in f.names))
    output = set(OutputRow.names())
    if cfg.keep_columns == "all":
        kept = [n for n in names if n != data.source.roles["id"] and n not in output]
        clash = [n for n in names if n in output and n != data.source.roles["id"]]
        if clash:
            log.info("input column(s) %s not copied to the output: the output has columns of that name "
                     "(--keep-columns names the ones to copy)", ", ".join(clash))
    else:
        kept = [c.strip() for c in cfg.keep_columns.split(",") if c.strip() and cfg.keep_columns != "none"]
        for c in kept:
            if c not in names:
                raise ConfigError(f"--keep-columns: no column {c!r} in the input (columns: "
                                  f"{', '.join(names)})")
            if c in output:
                raise ConfigError(f"--keep-columns: {c!r} is also an output column; leave it out (the "
                                  f"output's columns: {', '.join(OutputRow.names())})")
    return dataclasses.replace(cfg, keep_columns=",".join(kept) or "none")


def make_plan(cfg: JobConfig, dry_run: bool = False) -> JobPlan:
    """Check the job and find its keys still to do (no Ray). Locks the output, writes ``_job.json`` (new
    runs) and removes a previous run's ``_summary.json``; raises :class:`ConfigError` if the job cannot
    run. ``dry_run``: the same checks, but the output is only read (no lock, nothing written)."""
    t0 = time.perf_counter()
    cfg = as_openai_job(cfg)
    data = scan_ids(open_input(cfg), cfg.corpus_column, "n" if "n" in cfg.request_columns else None,
                    cfg.num_samples)
    default_corpus = check_corpora(cfg, data)
    model_path = check_model(cfg.gen.model, cfg.gen.trust_remote_code)
    uses_chat = cfg.gen.chat or "messages" in data.source.roles
    check_chat(model_path, cfg.gen.model, uses_chat, cfg.gen.chat_template)
    cfg = dataclasses.replace(cfg, gen=dataclasses.replace(cfg.gen, model_label=model_label(model_path)))
    timing = {"validate_s": time.perf_counter() - t0}
    t = time.perf_counter()
    references = build_references(cfg.references, cfg.gen, model_path)
    timing["reference_build_s"] = time.perf_counter() - t
    cfg = resolve_keep_columns(cfg, data)
    store = OutputStore(cfg.output, data.id_type, cfg.part_rows, cfg.part_seconds, keep=kept_columns(cfg),
                        allow_foreign=cfg.allow_foreign_files)
    if dry_run:
        if not cfg.overwrite:  # with --overwrite nothing written counts
            store.inspect(job_record(cfg), upgrade=upgrade_record)
    else:
        store.prepare(job_record(cfg), cfg.overwrite, upgrade=upgrade_record)
    todo = pending(data, store.existing, cfg.num_samples)
    stale = (store.existing.num_rows if store.existing is not None else 0) - todo.done
    if stale:
        log.warning("%d row(s) in %s are not in the input (or are samples beyond --num-samples)", stale,
                    cfg.output)
    timing["plan_s"] = time.perf_counter() - t0
    return JobPlan(data, model_path, references, store, todo, default_corpus, timing=timing, cfg=cfg)


def dry_run_report(cfg: JobConfig, plan: JobPlan, t0: float) -> dict:
    """What ``--dry-run`` prints: the plan's counts (the prompts of the rows to do are read and checked
    too), and the planning's time and peak memory."""
    import math
    import resource

    todo = plan.todo
    rejected, rejected_keys, examples = count_problems(plan.data, cfg, todo)
    return {"input": plan.data.source.source, "output": str(plan.store.root), "rows": len(plan.data),
            "num_samples": cfg.num_samples, "already_done": todo.done,
            "to_generate": todo.keys - rejected_keys,
            "rows_to_generate": todo.rows - rejected, "rejected_before_generation": rejected_keys,
            "rejected_rows": {"count": rejected, "first": examples},
            "batches": math.ceil((todo.rows - rejected) / cfg.rows_per_batch),
            "rows_per_batch": cfg.rows_per_batch,
            "replicas": cfg.actors, "actors": cfg.actors * cfg.tp,
            "part_files_at_least": math.ceil(todo.keys / cfg.part_rows),
            "model_path": str(plan.model_path), "plan_s": round(time.perf_counter() - t0, 2),
            "driver_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
