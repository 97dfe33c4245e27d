"""Recording acceptance traces (:mod:`logitspec.bench.trace`) with a real model on Spec-Bench or
LongBench-format
data: the real engine decodes greedily, a :class:`~logitspec.bench.trace.TraceRecorder` keeps every row's
trees and accepted nodes."""
from __future__ import annotations

import datetime
import pathlib
import re
from typing import NamedTuple, Sequence

from logitspec.bench.trace import Trace, TraceRecorder
from logitspec.engine.engine import Engine
from logitspec.engine.request import Request

from ..config import SpecConfig
from .longbench_set import longbench_questions
from .provenance import code_version
from .questions import PromptBuilder, load_questions, warmup_question

DATASETS = ("spec_bench", "longbench")


class Prompt(NamedTuple):
    id: str
    ids: list[int]  # token ids, the chat template applied where the data asks for it
    max_new_tokens: int


def spec_bench_prompts(engine: Engine, path=None, per_task: int = 1,
                       max_new_tokens: int = 128) -> list[Prompt]:
    """The first turn of the first ``per_task`` Spec-Bench questions of each task, as ``bench`` builds it."""
    build = PromptBuilder(engine.tokenizer, engine.encode)
    return [Prompt(f"{q.task}/{q.question_id}", build(q, 0, []), max_new_tokens)
            for q in load_questions(path, per_task)]


def longbench_prompts(engine: Engine, directory, per_dataset: int = 1,
                      max_new_tokens: int = 128) -> list[Prompt]:
    """The first ``per_dataset`` rows of each dataset in a LongBench-format ``directory``, as the
    evaluation sweep builds them (template, truncation, chat rule; the dataset's own answer length,
    at most ``max_new_tokens``)."""
    qs = longbench_questions(directory, engine.tokenizer, engine.encode, engine.max_context, per_dataset,
                             max_new_tokens)
    return [Prompt(q.question_id, list(q.turns[0]), q.max_new_tokens) for q in qs]


def record(engine: Engine, recorder: TraceRecorder, prompts: Sequence[Prompt], model_name: str, dataset: str,
           meta: dict | None = None) -> Trace:
    """Decode ``prompts`` (greedy) with ``engine``, built with ``recorder`` as its step observer, after one
    unrecorded warm-up call; the trace of the run."""
    vocab = engine.model.config.get_text_config(decoder=True).vocab_size
    engine.generate([warmup_question(engine.tokenizer, vocab).turns[0]], max_new_tokens=8)
    recorder.rows.clear()
    run = engine.run([p.ids for p in prompts], [Request(max_new_tokens=p.max_new_tokens) for p in prompts])
    seqs = recorder.take(run.results, [p.id for p in prompts])
    c = engine.config
    meta = {"recorded": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "code": code_version(), "budget": c.budget, "tokens_per_s": run.stats["tokens_per_s"],
            **(meta or {})}
    return Trace(model_name, c.method, dataset, c.max_batch_size, max(p.max_new_tokens for p in prompts),
                 tuple(seqs), meta)


def record_all(model, tokenizer, methods: Sequence[str], dataset: str, out_dir, model_name: str, *,
               batch_size: int = 1, per_task: int = 1, max_new_tokens: int = 128, questions=None,
               longbench_dir=None, meta: dict | None = None) -> list[pathlib.Path]:
    """A trace per method on ``dataset`` (one of :data:`DATASETS`), written to ``out_dir`` as
    ``<model>_<dataset>_<method>.json.gz``; their paths."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for method in methods:
        recorder = TraceRecorder()
        engine = Engine(model, tokenizer, SpecConfig(method=method, max_batch_size=batch_size),
                        step_observer=recorder)
        if dataset == "spec_bench":
            prompts = spec_bench_prompts(engine, questions, per_task, max_new_tokens)
        else:
            prompts = longbench_prompts(engine, longbench_dir, per_task, max_new_tokens)
        trace = record(engine, recorder, prompts, model_name, dataset, meta)
        slug = re.sub(r"[^A-Za-z0-9.-]+", "-", model_name).strip("-")
        paths.append(trace.save(out / f"{slug}_{dataset}_{method}.json.gz"))
        print(f"{paths[-1]}: {len(trace.sequences)} rows, MAT {trace.mat:.2f}")
    return paths
