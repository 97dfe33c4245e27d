"""Rows -> output rows with one engine. No Ray here: replicas wrap this, tests call it directly.

An :class:`~pipeline.rows.InputRow` gives one :class:`~pipeline.rows.OutputRow` per sample it asks for.
Each row is encoded first; a row the engine refuses (too long for the context, no chat template, ...)
becomes error rows and the others go on. If ``Engine.run`` raises on the batch, its prompts (a row, or
one sample of it) are retried one by one so only the failing ones become error rows. The parts
(:meth:`RowGenerator.prepare`, ``run``, ``assemble``) are also used by :mod:`pipeline.replica.streaming`.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from logitspec.engine.request import Request
from logitspec.engine.session import sample_seed

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


def ok_row(row: InputRow, sample: int, res, spec: GenerationSpec) -> OutputRow:
    """The output row of one sample's :class:`~logitspec.engine.engine.GenerationResult`."""
    s = res.stats
    return OutputRow(id=row.id, sample=sample, generation=res.text, finish_reason=res.finish_reason,
                     n_prompt_tokens=len(res.prompt_token_ids), n_new_tokens=len(res.token_ids),
                     steps=s["steps"], mean_accepted=s["mean_accepted"],
                     accepted_lengths=list(s["accepted_lengths"]), retrieval_success=s["retrieval_success"],
                     wall_s=s["wall_s"], method=spec.method, model=spec.model_label or spec.model,
                     corpus=row.corpus, accepted_from=s["accepted_from"],
                     verified_steps=s.get("verified_steps"))


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


class RowGenerator:
    """Generates output rows for batches of input rows with one :class:`logitspec.Engine`."""

    def __init__(self, engine, spec: GenerationSpec, references: dict | None = None):
        self.engine = engine
        self.spec = spec
        self.references = references or {}

    def __call__(self, rows: list[InputRow],
                 history: list[list[int]] | None = None) -> tuple[list[OutputRow], dict]:
        """(output rows: per input row in input order, its samples in order; batch stats). ``history``:
        other replicas' answers to add to this engine's history first (:meth:`absorb`)."""
        t0 = time.perf_counter()
        self.absorb(history)
        out, reqs = self.prepare(rows)
        engine_stats: dict = {}
        results: list[list] = []
        if reqs:
            try:
                run = self.run(reqs)
                results, engine_stats = self.split(reqs, run.results), dict(run.stats)
            except Exception as e:  # noqa: BLE001 - isolate the row(s) that fail
                log.warning("batch of %d rows failed (%s: %s); retrying them one by one",
                            len({q.pos for q in reqs}), type(e).__name__, e)
                results = [self.run_alone(q) for q in reqs]
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
            try:
                ids = self.engine.encode(r.prompt, apply_chat_template=spec.chat)
            except ValueError as e:
                out[i] = error_rows(r, str(e), spec)
                continue
            ref = self.references.get(r.corpus) if r.corpus is not None else None
            samples, request = list(r.samples), r.request or spec.request
            base = request.seed if request.seed is not None else spec.request.seed
            if samples == list(range(len(samples))):
                reqs.append(Prompt(i, ids, request.with_(seed=row_seed(base, r.id, 0), n=len(samples)), ref,
                                   samples))
            else:
                reqs += [Prompt(i, ids, request.with_(seed=row_seed(base, r.id, s), n=1), ref, [s])
                         for s in samples]
        return out, reqs

    def run(self, reqs: list[Prompt]):
        """One ``Engine.run`` over ``reqs``: its results (request by request, samples in order) and stats."""
        return self.engine.run([q.ids for q in reqs], [q.request for q in reqs],
                               reference=[q.ref for q in reqs])

    def run_alone(self, req: Prompt) -> list:
        """The results of one request run on its own; on an error, the error message per sample."""
        try:
            return self.run([req]).results
        except Exception as e:  # noqa: BLE001 - this request's samples become error rows
            return [f"{type(e).__name__}: {e}"] * len(req.samples)

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
                                  if isinstance(x, str) else ok_row(r, s, x, spec))
        return [r for rs in out for r in rs]
