"""LogitSpec generation as a Ray Data stage, in the shape of ``ray.data.llm``'s ``build_processor``.

    from pipeline.data_stage import ProcessorConfig, build_processor
    stage = build_processor(ProcessorConfig(gen=GenerationSpec(model="default"), concurrency=2))
    ray.data.read_parquet("in/").filter(...).pipe(stage).write_parquet("out/")   # or stage(ds)

Rows carry a ``prompt`` (text or token ids) or ``messages`` (a chat, the template applied), an optional
``sampling_params`` dict (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``,
``stop``; absent keys: the spec's request), an optional ``id`` (what a row's sampling seed derives from;
absent: the prompt itself) and an optional ``corpus`` (which reference a row drafts from). Each row
comes back with every input column and ``generated_text``, ``finish_reason``, ``num_input_tokens``,
``num_generated_tokens``, ``sample`` (a row asking for ``n`` samples comes back ``n`` times) and the
job's acceptance statistics (``mean_accepted``, ``accepted_lengths``, ``accepted_from``, ``steps``,
``verified_steps``, ``error``).

Ray Data runs it: ``map_batches`` over an actor pool whose actors each hold the job's streaming replica
(:class:`pipeline.replica.actor.StreamingEngineWorker`: the same model loading, reference attachment
and engine, torch on one thread), which decodes the batches an actor holds at once
(``max_concurrent_batches``) in one engine session, so rows of the next batch fill slots the current
one frees. Reference indexes are built once in the driver and put in Ray's object store (each actor
maps them, zero-copy). Ray Data streams, applies backpressure and sizes the pool; exactly-once resume
over runs is the job's (``logitspec job``), not a stage's.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from .errors import ConfigError
from .io.row_checks import REQUEST_KINDS, fits_request_column, row_problem, row_prompt
from .rows import InputRow, OutputRow
from .spec import GenerationSpec

# sampling_params keys -> the request's fields
SAMPLING_KEYS = {"max_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "seed": "seed", "n": "n", "stop": "stop"}
# output columns: the stage's name -> the job's OutputRow field
OUTPUTS = {"generated_text": "generation", "finish_reason": "finish_reason",
           "num_input_tokens": "n_prompt_tokens", "num_generated_tokens": "n_new_tokens", "sample": "sample",
           "mean_accepted": "mean_accepted", "accepted_lengths": "accepted_lengths",
           "accepted_from": "accepted_from", "steps": "steps", "verified_steps": "verified_steps",
           "error": "error"}


@dataclass(frozen=True)
class ProcessorConfig:
    """What the stage's actors are built from: the job's :class:`GenerationSpec` (model, method, draft
    settings, request), the pool and each actor's resources, the reference corpora."""

    gen: GenerationSpec = field(default_factory=GenerationSpec)
    concurrency: int | tuple[int, int] = 1  # actors: a fixed count, or (min, max) to autoscale
    batch_size: int = 16  # rows per batch handed to an actor
    max_concurrent_batches: int = 2  # batches an actor holds at once, decoded in one engine session
    num_cpus: float = 1.0  # per actor
    num_gpus: float = 0.0  # per actor
    threads: int | None = None  # torch threads per actor (None: num_cpus, at least 1)
    references: tuple[tuple[str, str], ...] = ()  # (name, path) corpora, as the job's --reference
    # model shards per replica: 1 (a Ray Data actor is one process; tensor-parallel replicas, groups of
    # actors, are the job's: logitspec job --tp N)
    tp: int = 1
    should_continue_on_error: bool = False  # a failed row: an error row (True), or the stage fails (False)

    def __post_init__(self) -> None:
        sizes = self.concurrency if isinstance(self.concurrency, tuple) else (self.concurrency,)
        if not sizes or len(sizes) > 2 or any(not isinstance(s, int) or s < 1 for s in sizes) or sizes != \
                tuple(sorted(sizes)):
            raise ConfigError(f"concurrency must be an int >= 1 or (min, max), got {self.concurrency!r}")
        for name in ("batch_size", "max_concurrent_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp != 1:
            raise ConfigError(f"tp={self.tp}: a stage's actor holds one whole model (a Ray Data actor is "
                              f"one process); for tensor-parallel replicas run the job: logitspec job "
                              f"--tp {self.tp}")
        if self.gen.share_history:
            raise ConfigError("share_history is the job's (its driver passes answers between replicas)")


def build_processor(config: ProcessorConfig, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Callable:
    """A function ``ray.data.Dataset -> ray.data.Dataset``: ``preprocess`` per row (``ds.map``), the
    generation stage, ``postprocess`` per row. The model and the references are checked, and the
    references built, here, before any actor starts (:class:`ConfigError`)."""
    from ray.data import ActorPoolStrategy

    from .io.model import check_chat, check_model
    from .job.plan import build_references

    model_path = check_model(config.gen.model, config.gen.trust_remote_code)
    check_chat(model_path, config.gen.model, config.gen.chat, config.gen.chat_template)
    built = build_references(config.references, config.gen, model_path)
    sizes = config.concurrency if isinstance(config.concurrency, tuple) else (config.concurrency,) * 2
    compute = ActorPoolStrategy(min_size=sizes[0], max_size=sizes[1],
                                max_concurrent_calls_per_actor=config.max_concurrent_batches,
                                enable_true_multi_threading=True)

    def stage(ds):
        import ray

        # once per corpus; 1-tuples, as the job passes them: Ray must not resolve them for the actor
        refs = {name: (ray.put(arrays),) for name, arrays in built.items()}
        if preprocess is not None:
            ds = ds.map(preprocess)
        ds = ds.map_batches(GenerationActor, fn_constructor_kwargs={"config": config, "reference_refs": refs},
                            batch_size=config.batch_size, batch_format="pyarrow", compute=compute,
                            num_cpus=config.num_cpus, num_gpus=config.num_gpus or None)
        return ds.map(postprocess) if postprocess is not None else ds

    return stage


class GenerationActor:
    """One actor of the stage's pool: the job's streaming replica
    (:class:`~pipeline.replica.actor.StreamingEngineWorker`: model, references, one engine session on
    one torch thread) shared by the batches it holds at once."""

    def __init__(self, config: ProcessorConfig, reference_refs: dict):
        from .replica.actor import StreamingEngineWorker

        self.config = config
        self.corpora = set(reference_refs)
        self.default_corpus = next(iter(reference_refs)) if len(reference_refs) == 1 else None
        threads = config.threads or max(1, int(config.num_cpus))
        self.replica = StreamingEngineWorker(config.gen, threads, config.num_gpus > 0, reference_refs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch's rows, each repeated per sample, with the output columns."""
        from .replica.worker import error_rows

        records = batch.to_pylist()
        rows, problems = [], {}
        for k, r in enumerate(records):
            row, problem = self.input_row(r)
            rows.append(row)
            if problem:
                problems[k] = problem
        todo = [r for k, r in enumerate(rows) if k not in problems]
        done = iter(self.replica.generate(todo)[0] if todo else [])  # row order, samples in order
        by_row = {k: error_rows(r, problems[k], self.config.gen) if k in problems
                  else [next(done) for _ in r.samples] for k, r in enumerate(rows)}
        take, out_rows = [], []
        for k in range(batch.num_rows):
            for out in by_row[k]:
                if out.error is not None and not self.config.should_continue_on_error:
                    raise RuntimeError(f"row {k} of its batch ({_describe(records[k])}) failed: {out.error}")
                take.append(k)
                out_rows.append(out)
        table = batch.take(pa.array(take, pa.int64())) if take else batch.slice(0, 0)
        table = table.drop([c for c in OUTPUTS if c in table.column_names])
        schema = OutputRow.schema()
        for name, source in OUTPUTS.items():
            typ = schema.field(source).type
            values = pa.array([getattr(o, source) for o in out_rows], typ)
            table = table.append_column(pa.field(name, typ), values)
        return table

    def input_row(self, r: dict) -> tuple[InputRow, str | None]:
        """Row ``k`` of the batch as an :class:`InputRow`, and its problem. Its id (what its sampling
        seeds derive from) is its ``id`` column, else a hash of its prompt."""
        gen = self.config.gen
        prompt, messages = r.get("prompt"), r.get("messages")
        problem = row_problem(prompt, messages, messages is not None)
        request, n = gen.request, gen.request.n
        params = {k: v for k, v in (r.get("sampling_params") or {}).items() if v is not None}
        unknown = sorted(set(params) - set(SAMPLING_KEYS))
        given = {SAMPLING_KEYS[key]: v for key, v in params.items() if key in SAMPLING_KEYS}
        bad = [f"{key} must be {REQUEST_KINDS[SAMPLING_KEYS[key]]}" for key, v in params.items()
               if key in SAMPLING_KEYS and not fits_request_column(SAMPLING_KEYS[key], v)]
        if unknown or bad:
            problem = problem or f"sampling_params: {'; '.join(bad + [f'unknown key {k}' for k in unknown])}"
        else:
            try:
                request = request.with_(**given)
                n = request.n
            except ValueError as e:
                problem = problem or f"sampling_params: {e}"
        key = r["id"] if r.get("id") is not None else _prompt_key(prompt, messages)
        text = None if problem else row_prompt(prompt, messages, messages is not None)
        corpus = r.get("corpus") or self.default_corpus
        if corpus is not None and corpus not in self.corpora:
            problem = problem or f"corpus {corpus!r} is not a reference of the stage ({sorted(self.corpora)})"
        return InputRow(key, text, corpus, tuple(range(n)), request), problem


def _prompt_key(prompt, messages) -> str:
    """A row's stable name without an id: a hash of what it asks (so its sampled draws do not depend on
    the batch it lands in)."""
    return hashlib.sha1(json.dumps([prompt, messages], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _describe(row: dict) -> str:
    shown = {k: v for k, v in row.items() if k in ("id", "prompt", "messages")}
    text = json.dumps(shown, default=str)
    return text if len(text) <= 200 else text[:197] + "..."

