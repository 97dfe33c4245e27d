"""Rows -> output rows with one engine. No Ray here: replicas wrap this, tests call it directly.

An :class:`~pipeline.rows.InputRow` gives one :class:`~pipeline.rows.OutputRow` per sample it asks for.
Each row is encoded first; a row the engine refuses (too long for the context, no chat template, ...)
becomes error rows and the others go on. If ``Engine.run`` runs out of memory on a batch, the batch is
split in halves and each retried (down to one prompt: one that does not fit alone becomes error rows
naming its size); if it raises anything else, its prompts (a row, or one sample of it) are retried one
by one, so only the failing ones become error rows. The parts (:meth:`RowGenerator.prepare`, ``run``,
``assemble``, :meth:`RowGenerator.recover`) are also used by :mod:`pipeline.replica.streaming`.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from logitspec.device import is_out_of_memory
from logitspec.engine.request import Request
from logitspec.engine.session import sample_seed
from logitspec.worker.kv_cache import kv_bytes_per_token

from ..rows import InputRow, OutputRow
from ..spec import GenerationSpec

log = logging.getLogger("pipeline.replica.worker")


def row_seed(base: int, row_id: Any, sample: int = 0) -> int:
    """The sampling seed of one sample of a row: sample 0 has a stable hash of (``--seed``, row id), in
    [0, 2**63); sample j the engine's :func:`~logitspec.engine.session.sample_seed` of that (so one
    ``Engine.run(..., n=N)`` with the row's seed draws exactly the samples 0..N-1).

    It depends on nothing else (not on shards, batches, actors, retries or ``--num-samples``), so a
    row's sample is the same however the job is split or resumed. Sample 0 keeps the seed rows had
    before samples existed.
    """
    key = f"{int(base)}\x00{type(row_id).__name__}\x00{row_id}".encode()
    return sample_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1, int(sample))


def error_row(row_id: Any, error: str, spec: GenerationSpec, corpus: str | None = None,
              n_prompt_tokens: int | None = None, sample: int = 0) -> OutputRow:
    return OutputRow(id=row_id, sample=sample, n_prompt_tokens=n_prompt_tokens, method=spec.method,
                     model=spec.model_label or spec.model, error=error, corpus=corpus)


def error_rows(row: InputRow, error: str, spec: GenerationSpec,
               n_prompt_tokens: int | None = None) -> list[OutputRow]:
    """One error row per sample of ``row``."""
    return [error_row(row.id, error, spec, row.corpus, n_prompt_tokens, s) for s in row.samples]


def truncate_tokens(ids: list[int], keep: int, how: str) -> list[int]:
    """``ids`` cut to ``keep`` tokens: its last ones (``left``: the beginning goes) or its first ``keep // 2``
    and last ``keep - keep // 2`` (``middle``: the middle goes, as LongBench cuts its prompts)."""
    if len(ids) <= keep:
        return list(ids)
    if how == "left":
        return list(ids[len(ids) - keep:])
    if how == "middle":
        head = keep // 2
        return list(ids[:head]) + list(ids[len(ids) - (keep - head):])
    raise ValueError(f"truncate must be left or middle, got {how!r}")


def ok_row(row: InputRow, sample: int, res, spec: GenerationSpec, truncated: bool = False) -> OutputRow:
    """The output row of one sample's :class:`~logitspec.engine.engine.GenerationResult`."""
    s = res.stats
    return OutputRow(id=row.id, sample=sample, generation=res.text, finish_reason=res.finish_reason,
                     n_prompt_tokens=len(res.prompt_token_ids), n_new_tokens=len(res.token_ids),
                     steps=s["steps"], mean_accepted=s["mean_accepted"],
                     accepted_lengths=list(s["accepted_lengths"]), retrieval_success=s["retrieval_success"],
                     wall_s=s["wall_s"], method=spec.method, model=spec.model_label or spec.model,
                     corpus=row.corpus, accepted_from=s["accepted_from"],
                     verified_steps=s.get("verified_steps"), truncated=truncated)


def free_memory() -> None:
    """Give back what a failed step left: Python's garbage, and CUDA's cached blocks."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Prompt:
    """One engine prompt of a task: samples ``samples`` of the task's row ``pos`` (``ids``: its prompt
    tokens, ``request``: its settings, seeded for its first sample and ``n`` its samples, ``ref``: its
    reference source or None)."""

    pos: int
    ids: list[int]
    request: Request
    ref: Any
    samples: list[int]
    truncated: bool = False  # ids were cut to fit the context (GenerationSpec.truncate)


class RowGenerator:
    """Generates output rows for batches of input rows with one :class:`logitspec.Engine`."""

    def __init__(self, engine, spec: GenerationSpec, references: dict | None = None):
        self.engine = engine
        self.spec = spec
        self.references = references or {}
        self.out_of_memory = 0  # batches that ran out of memory and were split (recover), so far

    def __call__(self, rows: list[InputRow],
                 history: list[list[int]] | None = None) -> tuple[list[OutputRow], dict]:
        """(output rows: per input row in input order, its samples in order; batch stats). ``history``:
        other replicas' answers to add to this engine's history first (:meth:`absorb`)."""
        t0 = time.perf_counter()
        self.absorb(history)
        out, reqs = self.prepare(rows)
        engine_stats: dict = {}
        results: list[list] = []
        ooms = self.out_of_memory
        if reqs:
            try:
                run = self.run(reqs)
                results, engine_stats = self.split(reqs, run.results), dict(run.stats)
            except Exception as e:  # noqa: BLE001 - isolate the row(s) that fail
                results = self.recover(reqs, e)
        engine_stats["out_of_memory"] = self.out_of_memory - ooms
        rows_out = self.assemble(rows, out, reqs, results)
        return rows_out, {"wall_s": time.perf_counter() - t0, "rows": len(rows), "engine": engine_stats,
                          **self.answers(results)}

    def absorb(self, history: list[list[int]] | None) -> None:
        """Add answers other replicas produced (token ids, oldest first) to the engine's history."""
        for answer in history or ():
            self.engine.history.add(answer)

    def answers(self, results: list[list]) -> dict:
        """``{"answers": token ids of this task's answers}`` when the job shares histories (newest
        last, at most ``history_tokens`` tokens: older ones would be dropped anyway), else ``{}``."""
        if not self.spec.share_history:
            return {}
        out, room = [], self.spec.history_tokens
        for x in reversed([x for res in results for x in res if not isinstance(x, str)]):
            if room <= 0:
                break
            out.append(list(x.token_ids[-room:]))
            room -= len(out[-1])
        return {"answers": out[::-1]}

    def prepare(self, rows: list[InputRow]) -> tuple[list[list[OutputRow]], list[Prompt]]:
        """Encode ``rows``: per row its error rows if the engine refuses it (else empty, to be filled by
        :meth:`assemble`), and the engine prompts of the others, in row order. A row asking for
        samples 0..N-1 is one prompt with ``n=N`` (one prefill shared by its samples); a row asking
        for other samples (a resume that lacks some) is one prompt per sample, each with its own seed
        (:func:`row_seed`): the same draws either way."""
        spec = self.spec
        out: list[list[OutputRow]] = [[] for _ in rows]
        reqs: list[Prompt] = []
        for i, r in enumerate(rows):
            request = r.request or spec.request
            try:
                ids, truncated = self.encode(r.prompt, request)
            except ValueError as e:
                out[i] = error_rows(r, str(e), spec, getattr(e, "n_prompt_tokens", None))
                continue
            ref = self.references.get(r.corpus) if r.corpus is not None else None
            samples = list(r.samples)
            base = request.seed if request.seed is not None else spec.request.seed
            if samples == list(range(len(samples))):
                reqs.append(Prompt(i, ids, request.with_(seed=row_seed(base, r.id, 0), n=len(samples)), ref,
                                   samples, truncated))
            else:
                reqs += [Prompt(i, ids, request.with_(seed=row_seed(base, r.id, s), n=1), ref, [s], truncated)
                         for s in samples]
        return out, reqs

    def encode(self, prompt, request: Request) -> tuple[list[int], bool]:
        """A row's prompt tokens, and whether they were cut: a prompt that leaves no room for the
        request's ``max_new_tokens`` in the model's context is cut to that room with
        ``GenerationSpec.truncate`` ``left`` or ``middle``; with ``error`` one that does not fit at all
        is a ValueError (carrying ``n_prompt_tokens``)."""
        ids = self.engine.encode(prompt, apply_chat_template=self.spec.chat, fit_context=False)
        context = self.engine.max_context
        if self.spec.truncate == "error":
            if len(ids) >= context:
                err = ValueError(f"prompt has {len(ids)} tokens; the model's context is {context} "
                                 "(--truncate left or middle cuts such prompts to fit)")
                err.n_prompt_tokens = len(ids)
                raise err
            return ids, False
        keep = max(1, context - request.max_new_tokens)
        return truncate_tokens(ids, keep, self.spec.truncate), len(ids) > keep

    def run(self, reqs: list[Prompt]):
        """One ``Engine.run`` over ``reqs``: its results (request by request, samples in order) and stats."""
        return self.engine.run([q.ids for q in reqs], [q.request for q in reqs],
                               reference=[q.ref for q in reqs])

    def run_alone(self, req: Prompt) -> list:
        """The results of one request run on its own; on an error, the error message per sample."""
        try:
            return self.run([req]).results
        except Exception as e:  # noqa: BLE001 - this request's samples become error rows
            if is_out_of_memory(e):
                free_memory()
                return [self.too_big(req, e)] * len(req.samples)
            return [f"{type(e).__name__}: {e}"] * len(req.samples)

    def recover(self, reqs: list[Prompt], err: BaseException) -> list[list]:
        """Per request, its results or error messages after ``Engine.run`` over ``reqs`` raised ``err``:
        out of memory, the requests are split in halves and each half retried (:meth:`run_split`);
        anything else, each request is retried alone."""
        rows = len({q.pos for q in reqs})
        if is_out_of_memory(err):
            self.out_of_memory += 1
            log.warning("out of memory on a batch of %d prompts (%d rows, %s); splitting it in halves",
                        len(reqs), rows, err)
            free_memory()
            return self.run_split(reqs)
        log.warning("batch of %d rows failed (%s: %s); retrying them one by one", rows, type(err).__name__,
                    err)
        return [self.run_alone(q) for q in reqs]

    def run_split(self, reqs: list[Prompt]) -> list[list]:
        """Per request its results: ``reqs`` run in two halves, a half that runs out of memory split
        again, down to one request (:meth:`run_alone`); any other error: each request alone."""
        if len(reqs) == 1:
            return [self.run_alone(reqs[0])]
        out: list[list] = []
        for half in (reqs[:len(reqs) // 2], reqs[len(reqs) // 2:]):
            try:
                out += self.split(half, self.run(half).results)
            except Exception as e:  # noqa: BLE001 - split again, or isolate
                out += self.recover(half, e)
        return out

    def too_big(self, req: Prompt, err: BaseException) -> str:
        """The error of a request that runs out of memory alone: what it needs and what failed."""
        tokens = len(req.ids) + req.request.max_new_tokens
        mib = tokens * req.request.n * kv_bytes_per_token(self.engine.model) / 2**20
        need = f", about {mib:,.1f} MiB of KV cache"
        return (f"out of memory: the prompt's {len(req.ids):,} tokens + {req.request.max_new_tokens:,} new "
                f"x {req.request.n} sample(s){need}, do not fit this replica alone "
                f"({type(err).__name__}: {str(err)[:200]})")

    @staticmethod
    def split(reqs: list[Prompt], results: list) -> list[list]:
        """Prompt-major ``results`` cut into one list per request."""
        it = iter(results)
        return [[next(it) for _ in q.samples] for q in reqs]

    def assemble(self, rows: list[InputRow], out: list[list[OutputRow]], reqs: list[Prompt],
                 results: list[list]) -> list[OutputRow]:
        """The output rows: ``out`` (from :meth:`prepare`) with each request's results (a
        ``GenerationResult``, or an error message, per sample) as rows, flattened in input order."""
        spec = self.spec
        for q, res in zip(reqs, results):
            r = rows[q.pos]
            for s, x in zip(q.samples, res):
                out[q.pos].append(error_row(r.id, x, spec, r.corpus, len(q.ids), s)
                                  if isinstance(x, str) else ok_row(r, s, x, spec, q.truncated))
        return [r for rs in out for r in rs]
