"""Running ``logitspec bench``: every method on every unit of Spec-Bench questions, side by side.

Every method runs in one process on the same prompts: after a warm-up (one call per method on a
built-in prompt that is never measured, :func:`~logitspec.bench.questions.warmup_question`), each unit
(a question-turn at batch size 1; up to ``max_batch_size`` questions of one task otherwise) is run by
all methods back to back, in an order rotated per unit, so machine noise hits them alike. One engine
per method lives for the whole run, as in a long-running job: what an engine keeps between calls (the
auto budget's learned acceptance rates, its cost curve) carries from unit to unit. Records, summary,
report and plots go to one directory (see :func:`run_bench`); the numbers are computed by
:mod:`logitspec.bench.report` from the records alone.

MT-bench's second turn: the prompt is the conversation with ``ar``'s first-turn answer, for every
method, so all methods see the same second-turn prompt.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys
from typing import Any, Sequence

from . import report
from .longbench_set import longbench_questions
from .methods import (
    DEFAULT_METHODS,
    ENGINE_OPTIONS,
    REFERENCE,
    EngineRunner,
    HFRunner,
    MethodSpec,
    describe,
    parse_methods,
)
from .provenance import code_version, load_average, machine_info
from .questions import (
    DEFAULT_QUESTIONS,
    PromptBuilder,
    Question,
    load_questions,
    select_questions,
    task_order,
    warmup_question,
)
from .results import resumable, write_outputs
from .samples import Decoding


def bench(model="default", questions=None, out_dir="bench_out",
          methods: str | Sequence[str] = DEFAULT_METHODS,
          per_task: int | None = None, categories: Sequence[str] | None = None,
          spec_bench: bool = True, **kwargs) -> dict:
    """Python twin of ``logitspec bench``: ``model`` is a spec for :func:`logitspec.models.load_model` or a
    ``(model, tokenizer)`` pair; ``questions`` a ``question.jsonl`` path (default: Spec-Bench beside the
    repository) or a list of :class:`Question`; ``spec_bench=False`` runs no Spec-Bench questions (then
    ``longbench=DIR`` must give some); other keywords go to :func:`run_bench` (``longbench``: also the
    first ``per_task`` rows of each data set in that LongBench-format directory)."""
    parse_methods(methods)  # fail on a typo before loading anything
    if not spec_bench:
        if kwargs.get("longbench") is None:
            raise ValueError("no questions: spec_bench=False needs longbench=DIR")
        qs = []
    elif questions is None or isinstance(questions, (str, os.PathLike)):
        qs = load_questions(questions, per_task, categories)
        kwargs.setdefault("settings", {"questions_file": str(questions or DEFAULT_QUESTIONS),
                                       "per_task": per_task,
                                       "categories": list(categories) if categories else None})
    else:
        qs = select_questions(list(questions), per_task, categories)
    kwargs.setdefault("longbench_per_task", per_task)
    if isinstance(model, tuple):
        model_obj, tok = model
        kwargs.setdefault("model_name", getattr(model_obj.config, "name_or_path", None)
                          or type(model_obj).__name__)
    else:
        from ..models import load_model

        model_obj, tok = load_model(model)
        kwargs.setdefault("model_name", str(model))
    return run_bench(model_obj, tok, qs, out_dir, methods, **kwargs)


def _units(questions: Sequence[Question], batch: int) -> list[list[Question]]:
    """Groups of up to ``batch`` questions of one task, in order."""
    groups: list[list[Question]] = []
    for q in questions:
        if groups and len(groups[-1]) < batch and groups[-1][0].task == q.task:
            groups[-1].append(q)
        else:
            groups.append([q])
    return groups


def run_bench(model, tokenizer, questions: Sequence[Question], out_dir,
              methods: str | Sequence[str] = DEFAULT_METHODS,
              max_new_tokens: int = 64, max_batch_size: int = 1, capacity: int | None = None,
              top_k: int | None = None, runner: str | None = None, warmup: bool = True,
              warmup_tokens: int = 16, progress: bool = True,
              model_name: str = "?", command: str | None = None, settings: dict | None = None,
              resume: bool = False, decoding: Decoding = Decoding(), longbench=None,
              longbench_per_task: int | None = None) -> dict:
    """Run every method on every question-turn, write ``results.jsonl``, ``summary.json``, ``report.md``
    and PNG plots into ``out_dir``, and return the summary.

    ``longbench``: a LongBench-format directory whose first ``longbench_per_task`` rows per data set are
    added after ``questions`` (prompts as the evaluation sweep builds them, with the model's tokenizer and
    context; each data set a task, its answers at most its own length and ``max_new_tokens``).

    ``questions`` may hold token-id turns (then ``tokenizer`` may be None). ``capacity`` / ``top_k`` set
    those SpecConfig fields for every engine method (a variant's own ``@field=`` wins). ``warmup``: one
    call per method first, ``warmup_tokens`` long, on a built-in prompt that is not measured. ``resume``
    keeps the complete units already in ``out_dir/results.jsonl`` (same settings required) and runs
    the rest, in the same rotation. ``decoding``: greedy (the default) or sampled, with
    ``num_samples`` records per question-turn (each sample seeded alike for every method).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    specs = parse_methods(methods)
    runners = _make_runners(model, tokenizer, specs, max_batch_size, capacity, top_k, decoding, runner)
    names = [s.name for s in specs]
    ref = runners[REFERENCE].engine
    build = PromptBuilder(tokenizer, ref.encode)
    if longbench is not None:
        questions = list(questions) + longbench_questions(longbench, tokenizer, ref.encode, ref.max_context,
                                                          longbench_per_task, max_new_tokens)
    if not questions:
        raise ValueError("no questions to run")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = _units(list(questions), max_batch_size)
    summary = _start_summary(model, model_name, command, questions, {
        "methods": names, "max_new_tokens": max_new_tokens, "max_batch_size": max_batch_size,
        "capacity": capacity, "top_k": top_k, "runner": runner, "warmup": warmup,
        "warmup_tokens": warmup_tokens,
        "warmup_prompt": "built-in, not measured" if warmup else None,
        "temperature": decoding.sampling.temperature, "top_p": decoding.sampling.top_p,
        "sampling_top_k": decoding.sampling.top_k,
        "num_samples": decoding.num_samples, "seed": decoding.seed, "decoding": decoding.describe(),
        "chat_template": build.chat, **(settings or {})})
    kept = resumable(out, summary, names) if resume else {}
    if kept:
        summary["resumed"] = {"at": summary["started"], "kept_question_turns": len(kept)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    n_turns = sum(len(q.turns) for q in questions)
    bar = _progress(total=len(names) * (n_turns + (1 if warmup else 0)), enabled=progress)
    warm = {}
    if warmup:
        vocab = model.config.get_text_config(decoder=True).vocab_size
        prompt = build(warmup_question(tokenizer, vocab), 0, [])
        # as many prompts as the first unit has, so a batching engine warms up its batched path
        warm = _warm_up(runners, names, [prompt] * len(groups[0]), min(warmup_tokens, max_new_tokens), bar)
    with open(out / "results.jsonl", "w", encoding="utf-8") as f:
        records = _run_units(runners, names, build, groups, kept, max_new_tokens, f, bar, decoding)
    bar.close()
    summary["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    summary["load_average"]["end"] = load_average()
    summary["warmup_wall_s"] = warm
    summary["methods"] = report.summarize(records, REFERENCE, names)
    summary["method_configs"] = {name: describe(r) for name, r in runners.items()}
    write_outputs(summary, out)
    return summary


def _make_runners(model, tokenizer, specs: list[MethodSpec], max_batch_size: int, capacity: int | None,
                  top_k: int | None, decoding: Decoding, runner: str | None = None) -> dict[str, Any]:
    """One runner per method: the engine methods first (the HF baselines take the reference's EOS ids)."""
    from ..config import SpecConfig

    base_cfg = {"max_batch_size": max_batch_size}
    if capacity is not None:
        base_cfg["capacity"] = capacity
    if top_k is not None:
        base_cfg["top_k"] = top_k
    if runner is not None:
        base_cfg["runner"] = runner
    runners: dict[str, Any] = {}
    for s in specs:  # build every config first: a bad variant fails before any forward
        if not s.is_hf:
            fields = {k: v for k, v in s.overrides.items() if k not in ENGINE_OPTIONS}
            cfg = SpecConfig(method=s.base, **{**base_cfg, **fields})
            runners[s.name] = EngineRunner(model, tokenizer, cfg, decoding,
                                           history=int(s.overrides.get("history", 0)),
                                           datastore=s.overrides.get("datastore"))
    eos = runners[REFERENCE].engine.eos_ids
    for s in specs:
        if s.is_hf:
            runners[s.name] = HFRunner(model, tokenizer, eos, s.overrides, s.base, decoding)
    return runners


def _start_summary(model, model_name: str, command: str | None, questions: Sequence[Question],
                   settings: dict) -> dict:
    """The summary as first written, before any measured run (``finished`` is null until the end)."""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    code = code_version()  # now: the modules were imported from this tree, whatever changes later
    load_start = load_average()
    return {
        "model": {"name": model_name, "class": type(model).__name__,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "machine": machine_info(model),
        "command": command,
        "code": code,
        "settings": settings,
        "reference": REFERENCE,
        "questions": len(questions),
        "tasks": task_order(q.task for q in questions),
        "question_turns_per_task": _count_turns(questions),
        "started": started,
        "finished": None,  # null in the file while the run is going (or if it died): see rerender()
        "load_average": {"start": load_start, "end": None},
        "warmup_wall_s": None,
        "methods": {},
    }


def _warm_up(runners: dict, names: list[str], prompts: list[list[int]], tokens: int, bar) -> dict[str, float]:
    """One unmeasured call per method; returns its wall time per method."""
    warm = {}
    for name in names:
        bar.set_postfix_str(f"warm-up {name}", refresh=False)
        warm[name] = runners[name].run(prompts, tokens)[0]
        bar.update(1)
    return warm


def _run_units(runners: dict, names: list[str], build: PromptBuilder, groups: list[list[Question]],
               kept: dict, max_new_tokens: int, f, bar, decoding: Decoding) -> list[dict]:
    """Every unit by every method; a unit's records are written to ``f`` whole, in method order."""
    records: list[dict] = []
    unit = 0
    width = max(len(g) for g in groups)  # seeds: prompt k of unit u is the run's (u * width + k)-th
    for group in groups:
        answers: dict[Any, list] = {q.question_id: [] for q in group}
        for turn in range(max(len(q.turns) for q in group)):
            qs = [q for q in group if turn < len(q.turns)]
            old = [kept.get((q.question_id, turn)) for q in qs]
            if all(old):  # done before: keep its records (and the reference's answers)
                unit_records = {name: [r for rs in old for r in rs[name]] for name in names}
                bar.update(len(qs) * len(names))
            else:
                prompts = [build(q, turn, answers[q.question_id]) for q in qs]
                seeds = decoding.seeds(unit * width, len(qs))
                # a unit is one task's: its questions share their own answer length, if they have one
                new = min([max_new_tokens] + [q.max_new_tokens for q in qs if q.max_new_tokens])
                unit_records = _run_unit(runners, names, qs, turn, unit, prompts, new, bar, seeds)
            # the next turn sees sample 0
            for q, r in zip(qs, unit_records[REFERENCE][::decoding.num_samples]):
                answers[q.question_id].append(r["token_ids"])
            for name in names:  # written in method order, whatever order they ran in
                for r in unit_records[name]:
                    f.write(json.dumps(r) + "\n")
                    records.append(r)
            f.flush()
            unit += 1
    return records


def _run_unit(runners: dict, names: list[str], qs: list[Question], turn: int, unit: int,
              prompts: list[list[int]], max_new_tokens: int, bar, seeds: list[int]) -> dict[str, list[dict]]:
    """One unit by every method back to back, the order rotated by one method per unit; a record per
    question and sample. Sampled, ``same_as_ar`` says whether a method drew the same tokens as ``ar``
    from the same seed (the engine draws one uniform per emitted token); HF's draws are its own (None)."""
    order = names[unit % len(names):] + names[: unit % len(names)]
    unit_records = {}
    for pos, name in enumerate(order):
        bar.set_postfix_str(f"{qs[0].task} q{qs[0].question_id} t{turn + 1} {name}", refresh=False)
        wall, outs = runners[name].run(prompts, max_new_tokens, seeds)
        n = len(outs) // len(qs)  # samples per question
        unit_records[name] = [_record(name, qs[i // n], turn, unit, pos, prompts[i // n], o, wall, len(outs),
                                      i % n)
                              for i, o in enumerate(outs)]
        bar.update(len(qs))
    for name in names:
        comparable = runners[name].decoding.greedy or isinstance(runners[name], EngineRunner)
        for r, a in zip(unit_records[name], unit_records[REFERENCE]):
            r["same_as_ar"] = r["token_ids"] == a["token_ids"] if comparable else None
    return unit_records


def _count_turns(questions: Sequence[Question]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for q in questions:
        counts[q.task] = counts.get(q.task, 0) + len(q.turns)
    return counts


def _record(name, q: Question, turn, unit, pos, prompt, o: dict, wall, n, sample: int = 0) -> dict:
    r = {"method": name, "question_id": q.question_id, "category": q.category, "task": q.task, "turn": turn,
         "sample": sample, "unit": unit, "order": pos, "prompt_tokens": len(prompt),
         "new_tokens": len(o["token_ids"]),
         "wall_time": o.get("wall_time", wall), "unit_wall_time": wall if n > 1 else None, "batch": n}
    r.update({k: v for k, v in o.items() if k != "wall_time"})
    r["tokens_per_s"] = r["new_tokens"] / r["wall_time"] if r["wall_time"] > 0 else None
    return r


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    # off a terminal (nohup, CI logs) a line every 30 s instead of a redraw per run
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True,
                mininterval=interval)
