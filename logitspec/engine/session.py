"""The engine's loop as a session that takes new prompts while others decode (continuous batching).

A :class:`Session` (from :meth:`Engine.open`) holds the batch: ``submit`` queues a prompt (its
``n`` samples share one prefill), and each ``step`` does one iteration:

1. admit prefilled samples into free slots (their first token comes from the prefill's output);
2. prefill the next waiting prompts: a long prompt one chunk of ``prefill_chunk`` tokens per
   iteration while other rows decode (so they are never stalled for a whole long prefill); short
   prompts several to a forward, up to ``fill_chunk`` tokens per iteration; a batch filling up from
   empty is prefilled until its slots are full;
3. one decoding step of every active row: the speculation policy drafts a tree per row -> the model
   runner's forward over all trees -> acceptance per row (:mod:`logitspec.sample.acceptance`) -> the runner's
   cache commits the accepted paths -> the rows emit; finished rows are returned, their slots freed.

Every row keeps its request's own settings (sampling, seed, token limit, stop strings): rows with
different settings share a step, each decoding exactly as it would alone. The session reaches the
model only through its :class:`~logitspec.worker.runner.ModelRunner` and drafting only through its
:class:`~logitspec.spec_decode.policy.SpeculationPolicy` (both in :class:`SessionParts`).
:meth:`Engine.run` is ``submit`` for every prompt, then ``step`` until the session is idle.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from logitspec.config import SpecConfig
from logitspec.engine.request import Request
from logitspec.engine.sequence import DecodingSequence, GenerationResult
from logitspec.engine.step_clock import StepClock
from logitspec.sample.acceptance import accept_step, next_guesses
from logitspec.sample.node_logits import NodeLogits, OutputMode
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import next_token
from logitspec.spec_decode.policy import SpeculationPolicy
from logitspec.worker.masks import StepRow
from logitspec.worker.prefix_cache import PrefixCache
from logitspec.worker.runner import ModelRunner

# prompt tokens per forward of short prompts prefilled together into an idle batch (Engine's
# fill_chunk default): 24 Spec-Bench prompts (2,808 tokens) took 2 forwards instead of 8 at 512 tokens
# a forward, and the decoder's GEMMs run faster at 1-2k rows than at 300-500 (docs/performance.md)
FILL_CHUNK = 2048


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a prompt whose seed is ``seed``: ``seed`` itself for sample 0
    (so ``n=1`` is unchanged), else a 63-bit hash of (seed, sample) (stable across runs and
    machines, independent of batch composition)."""
    if sample == 0:
        return int(seed)
    words = np.random.SeedSequence([int(seed) & (2**64 - 1), sample]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


@dataclass(frozen=True)
class SessionParts:
    """What a session works with, made once by the :class:`~logitspec.engine.engine.Engine`."""

    runner: ModelRunner
    policy: SpeculationPolicy
    config: SpecConfig
    encode: Callable[[Any, bool], list[int]]  # (prompt, apply_chat_template) -> token ids; ValueError
    tokenizer: Any  # for stop strings and texts (None: token ids only)
    eos_ids: frozenset[int]
    prefill_chunk: int  # prompt tokens per prefill forward of one long prompt
    fill_chunk: int  # prompt tokens per forward of short prompts prefilled together
    prefix_cache: PrefixCache | None = None
    history: Any = None  # an n-gram source fed with every finished answer (HistorySource)
    sample_on_host: bool = True  # walk sampled trees on the host (else decide where the logits are)
    screened_sampling: bool = True  # ... drawing from the greedy screen's scores where there is one
    overlap: bool = False  # prefill while a step's forward runs on the device (Engine's ``overlap``)

    def mode(self, params: SamplingParams) -> OutputMode:
        """The output a row sampled with ``params`` needs: float32 rows of every node for sampling,
        unless the host walk draws from the screen."""
        if params.greedy:
            return OutputMode.GREEDY
        return OutputMode.SCREENED if self.sample_on_host and self.screened_sampling else OutputMode.EXACT


@dataclass
class _Request:
    """A submitted prompt and its prefill."""

    rid: int
    ids: list[int]
    request: Request
    max_new: int  # the request's, within the model's context
    seeds: list[int]  # one per sample
    ref: Any
    admitted: int = 0  # samples admitted so far
    row: Any = None  # the prompt's KV (one row, filled chunk by chunk; or a group's cache)
    row_index: int = 0  # the prompt's row in ``row``
    last: Any = None  # the last prompt token's output, once prefilled
    done_tokens: int = 0  # prompt tokens in ``row``
    prefill_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    siblings: list | None = None  # its samples' indexes, when it has several (a sibling draft source)


class Session:
    """Rows in flight on one engine; see the module docstring. Not thread-safe."""

    def __init__(self, parts: SessionParts, defaults: Request, seed: int = 0,
                 apply_chat_template: bool = False):
        self.parts, self.runner, self.policy, self.config = parts, parts.runner, parts.policy, parts.config
        self.defaults, self.seed, self.apply_chat_template = defaults, seed, apply_chat_template
        self.kv = self.runner.new_batch(self.config.max_batch_size)  # rows admitted later: written in place
        self.active: list[DecodingSequence] = []  # decoding sequences, one per KV row
        self.pending: deque[_Request] = deque()  # waiting for their prefill
        self.ready: deque[_Request] = deque()  # prefilled, samples waiting for slots
        self.prefilling: _Request | None = None
        self.steps = self.active_sum = self.prefill_chunks = self.prefills = 0
        self._idle = 0  # free slot-steps since the last refill while rows decode (SpecConfig.refill_wait)
        self._next_id = 0

    # ------------------------------------------------------------------ api
    def submit(self, prompt, request: Request | None = None, *, reference=None) -> int:
        """Queue ``prompt`` (string, chat messages or token ids) with its settings (``request``; None:
        the session's defaults); its request id (0, 1, ... in submission order). A request without a
        seed is seeded with the session's seed + its request id; sample j uses :func:`sample_seed`
        (seed, j). ``reference``: an n-gram source consulted after the sequence's own context.
        ValueError for bad input, before any forward."""
        request = request or self.defaults
        if request.stop and self.parts.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        ids = self.parts.encode(prompt, self.apply_chat_template)
        rid = self._next_id
        base = self.seed + rid if request.seed is None else int(request.seed)
        max_new = min(request.max_new_tokens, self.runner.max_context - len(ids))
        seeds = [sample_seed(base, j) for j in range(request.n)]
        self.pending.append(_Request(rid, ids, request, max_new, seeds, reference,
                                     siblings=[] if request.n > 1 else None))
        self._next_id += 1
        return rid

    @property
    def busy(self) -> bool:
        """Whether any submitted prompt has samples not yet finished."""
        return bool(self.pending or self.ready or self.prefilling or self.active)

    @property
    def free_slots(self) -> int:
        """Rows the batch could still take beyond those in flight or prefilled and waiting."""
        queued = sum(len(r.seeds) for r in self.pending)
        queued += len(self.prefilling.seeds) if self.prefilling else 0
        return max(0, self._open_slots() - queued)

    def _open_slots(self) -> int:
        """Slots neither decoding nor promised to prefilled samples waiting for admission."""
        promised = sum(len(r.seeds) - r.admitted for r in self.ready)
        return self.config.max_batch_size - len(self.active) - promised

    @torch.inference_mode()
    def step(self) -> list[GenerationResult]:
        """One iteration (admit, one prefill chunk, one decoding step); the results finished in it."""
        finished: list = []
        # rows decode: the next prompts are prefilled beside this step (admitted at the next step's start)
        overlap = self.parts.overlap and bool(self.active)
        if overlap:
            self._admit_ready(finished)  # prefilled during (or after) the last step
        else:
            self._fill(finished)
        beside = False
        if self.active:
            # draining: no prompt waits for a slot, so the batch ends with its slowest row
            draining = not (self.pending or self.ready or self.prefilling)
            beside = self._decode(draining, overlap)
            self.steps += 1
            self.active_sum += len(self.active)
            now = time.perf_counter()
            for s in self.active:
                s.stats.mark_emit(now)
            still = [i for i, s in enumerate(self.active) if not s.finish]
            finished += [self._result(s) for s in self.active if s.finish]
            self.active = [self.active[i] for i in self.kv.keep_rows(still)]
        if overlap and not beside:  # the step's result was read at once: the plain order's fill, a step early
            self._fill(finished)
        return finished

    def drain(self) -> list[GenerationResult]:
        """Step until idle; every result finished meanwhile."""
        out: list = []
        while self.busy:
            out += self.step()
        return out

    @property
    def stats(self) -> dict[str, float]:
        """``batch_steps`` (decoding forwards), ``mean_active`` (rows per decoding forward),
        ``prefills`` (prompts prefilled, fully or partly) and ``prefill_chunks`` (their forwards)."""
        return {"batch_steps": self.steps, "mean_active": self.active_sum / self.steps if self.steps else 0.0,
                "prefills": self.prefills, "prefill_chunks": self.prefill_chunks}

    # ------------------------------------------------------------------ loop
    def _fill(self, finished: list) -> None:
        """Prefill the next prompts while slots are free, then admit the prefilled samples: their
        rows join the batch's cache in one copy per iteration, however many forwards prefilled them."""
        self._prefill_waiting()
        self._admit_ready(finished)

    def _prefill_waiting(self) -> None:
        """Prefill while slots are free: when rows are decoding, short fresh prompts together (several
        rows in one forward, :meth:`_prefill_group`) up to ``fill_chunk`` tokens, or one chunk of
        ``prefill_chunk`` tokens of a long prompt; otherwise (a batch filling up from empty) until the
        slots are full."""
        decoding = bool(self.active)
        if decoding and self.prefilling is None and self.pending and not self._refill_due():
            return
        spent = 0  # prompt tokens prefilled in this iteration
        while True:
            slots = self._open_slots()
            if slots <= 0 and self.prefilling is None:
                return
            if self.prefilling is None:
                if not self.pending:
                    return
                # short prompts for free slots: up to fill_chunk tokens in all per iteration, also while
                # rows decode (measured: 24 slots refilled from 96 prompts, 172-174 tokens/s at 512 tokens
                # a step, 182-187 at 2,048; fewer, larger forwards, and slots filled sooner)
                fill = self.parts.fill_chunk
                group = self._take_group(slots, fill - spent if decoding else fill)
                if group:
                    spent += self._prefill_group(group)
                    continue
                if not self.pending:  # every prompt taken was a whole cache hit: admit them
                    continue
                if decoding and spent:
                    return
                self.prefilling = self._start(self.pending.popleft())
            req = self.prefilling
            if req.last is None:
                size = min(self.parts.prefill_chunk, len(req.ids) - req.done_tokens)
                if decoding and spent and spent + size > self.parts.prefill_chunk:
                    return  # rows are decoding: at most one chunk's worth of prompt tokens per step
                self._prefill_chunk(req)
                spent += size
            if req.last is not None:
                self.ready.append(req)
                self.prefilling = None

    def _refill_due(self) -> bool:
        """While rows decode and prompts wait: count this step's free slots as idle slot-steps; True
        (and the count restarts) once they reach ``SpecConfig.refill_wait`` decoding steps of the
        whole batch, or once half the batch is free."""
        B, free = self.config.max_batch_size, self._open_slots()
        if free <= 0:
            return False
        self._idle += free
        if self._idle < self.config.refill_wait * B and 2 * free < B:
            return False
        self._idle = 0
        return True

    def _take_group(self, slots: int, budget: int) -> list[_Request]:
        """Waiting prompts from the front of the queue to prefill in one forward: those the prefix
        cache does not hold at all, each short enough for one chunk, while their tokens (run back to
        back, unpadded) stay within ``budget`` and their samples within ``slots``.
        Whole cache hits found on the way go straight to ``ready``. Empty when the front prompt
        must go alone (a partial cache hit, or a prompt longer than a chunk)."""
        group: list[_Request] = []
        tokens = samples = 0
        while self.pending and samples < slots:
            req = self.pending[0]
            if tokens + len(req.ids) > budget or (group and samples + len(req.seeds) > slots):
                break
            self._start(self.pending.popleft())
            if req.last is not None:  # the whole prompt was cached: nothing to run
                self.ready.append(req)
                continue
            if req.done_tokens:  # partly cached: it continues alone from its cached prefix (begun already)
                self.pending.appendleft(req)
                break
            group.append(req)
            tokens, samples = tokens + len(req.ids), samples + len(req.seeds)
        return group

    def _prefill_group(self, group: list[_Request]) -> int:
        """Prefill the prompts of ``group`` (none cached, each within one chunk) in one forward;
        they become ready, sharing the group's cache. The forward's time is shared evenly among
        them. Tokens run."""
        t0 = time.perf_counter()
        # what the prompts need together
        mode = OutputMode.for_rows(self.parts.mode(r.request.sampling) for r in group)
        rows, lasts = self.runner.prefill_rows([r.ids for r in group], mode=mode)
        share = (time.perf_counter() - t0) / len(group)
        for b, (req, last) in enumerate(zip(group, lasts)):
            req.row, req.row_index, req.done_tokens, req.prefill_s = rows, b, len(req.ids), share
            self._prefilled(req, last, mode)
            self.ready.append(req)
        self.prefill_chunks += 1
        self.prefills += len(group)
        return sum(len(r.ids) for r in group)

    def _start(self, req: _Request) -> _Request:
        """Begin the prompt's prefill from what the prefix cache holds of it (the whole prompt: nothing
        is left to run); a request already begun is returned as it is."""
        if req.row is not None:
            return req
        cache = self.parts.prefix_cache
        kind = self.parts.mode(req.request.sampling).value
        hit = cache.lookup(req.ids, kind) if cache is not None else None
        if hit is None:
            req.row = self.runner.new_row(reserve=len(req.ids))
        else:
            req.row, req.last, req.done_tokens = hit.row, hit.last, hit.tokens
            req.cached_tokens = hit.tokens
        return req

    def _prefill_chunk(self, req: _Request) -> None:
        """Run the prompt's next chunk; once all is in, keep the last token's output (and store the
        row in the prefix cache)."""
        t0 = time.perf_counter()
        part = req.ids[req.done_tokens:req.done_tokens + self.parts.prefill_chunk]
        mode = self.parts.mode(req.request.sampling)
        last = self.runner.extend(req.row, part, mode=mode)
        req.done_tokens += len(part)
        self.prefill_chunks += 1
        self.prefills += req.done_tokens == len(part) + req.cached_tokens
        if req.done_tokens == len(req.ids):
            self._prefilled(req, last, mode)
        req.prefill_s += time.perf_counter() - t0

    def _prefilled(self, req: _Request, last: NodeLogits, mode: OutputMode) -> None:
        """The whole prompt is in ``req.row`` (row ``req.row_index``): keep its last token's output
        (of kind ``mode``), and the row in the prefix cache (keyed by that kind)."""
        req.last = last
        if self.parts.prefix_cache is not None:
            self.parts.prefix_cache.store(req.ids, mode.value, req.row, last, index=req.row_index)

    def _admit_ready(self, finished: list) -> None:
        """Start prefilled samples in free slots; their KV rows are added to the batch in one go (a
        prompt's row once per admitted sample)."""
        sources: list[tuple[Any, int, int]] = []
        free = False  # the last source's row is needed by no other sample (its request fully admitted)
        while self.ready and len(self.active) < self.config.max_batch_size:
            req = self.ready[0]
            count = min(len(req.seeds) - req.admitted, self.config.max_batch_size - len(self.active))
            started = []
            for j in range(req.admitted, req.admitted + count):
                seq = self._start_sequence(req, j)
                seq.stats.prefill_s = req.prefill_s if j == 0 else 0.0
                seq.stats.shared_prefill = j > 0
                seq.stats.cached_prompt_tokens = req.cached_tokens
                seq.stats.mark_emit(time.perf_counter())
                if seq.finish:
                    finished.append(self._result(seq))
                else:
                    started.append(seq)
            if started:
                sources.append((req.row, req.row_index, len(started)))
                free = req.admitted + count == len(req.seeds)
                self.active += started
            req.admitted += count
            if req.admitted == len(req.seeds):
                self.ready.popleft()
                req.row = None
        if len(sources) == 1 and free and sources[0][2] == 1 and sources[0][0].rows == 1 and not self.kv.rows:
            self.kv.add_row(sources[0][0], take=True)  # a one-row prefill into an empty batch: no copy
        elif sources:
            self.kv.add_rows(sources)

    # ------------------------------------------------------------------ rows
    def _start_sequence(self, req: _Request, j: int) -> DecodingSequence:
        """Sample ``j`` of the prefilled ``req`` as a sequence with its first token (picked from the
        prefill's output); the caller adds its KV row unless it already finished."""
        q, c = req.request, self.config
        sources = [(req.ref, "reference"), (self.parts.history, "history")]
        siblings = req.siblings if c.sibling_drafts else None
        seq = DecodingSequence.start((req.rid, j), req.ids, req.max_new, q.sampling, req.seeds[j],
                                     list(q.stop), sources, c.max_ngram, c.min_ngram, siblings)
        last = req.last  # the final prompt token's output, [1, V]
        tok = next_token(last, 0, q.sampling, seq.generator)
        seq.guesses = next_guesses([last], [[0]], [tok], [None], self.policy.guess_count)[0]
        seq.draft_state = self.policy.new_state(req.ids)
        seq.emit([tok], self.parts.eos_ids, self.parts.tokenizer)
        seq.stats.add_step(1, retrieved=False)  # the prefill forward emits the first token
        return seq

    def _decode(self, draining: bool, overlap: bool = False) -> bool:
        """One decoding step of every active row (``kv`` row b is ``active[b]``'s): draft -> target
        forward -> accept -> commit -> emit. ``draining``: see :meth:`SpeculationPolicy.draft`.
        ``overlap``: the next prompts are prefilled once a decided step's forward is queued and before
        its result is read (on a GPU their packing overlaps the step's device time and their forward
        queues behind the step's), timed apart from the step. Whether they were."""
        active, clock = self.active, StepClock()
        plan = self.policy.draft(active, draining)
        trees = plan.trees
        rows = [StepRow.from_tree(s.length - 1, tree) for s, tree in zip(active, trees)]
        clock.lap("draft_s")
        cols = self.kv.columns
        fwd = self.runner.step(rows, self.kv, OutputMode.for_rows(self.parts.mode(s.params) for s in active))
        clock.lap("forward_s", pack_s=fwd.pack_s)  # on a GPU: queued; the wait for it falls into verify_s
        timings = clock.times
        # beside a decided step only: its result is a few ints read on their own event, where another
        # step's [N, V] logits would stay alive through the prefill's activations
        beside = overlap and fwd.decision is not None
        if beside:
            chunks = self.prefill_chunks
            self._prefill_waiting()
            clock.skip()  # its time is the prompts' (prefill_s), not this step's
            if self.prefill_chunks != chunks:  # the step's wait hid or held some prefill: not learned from
                timings = None  # (the same on every rank of a group: prefill work is no rank's choice)
        k, want = plan.guesses, self.policy.wants_node_outputs
        params, generators = [s.params for s in active], [s.generator for s in active]
        acc = accept_step(trees, fwd, params, generators, k, self.parts.sample_on_host, outputs=want,
                          override_last=self.policy.accept_override(trees))
        paths, bonus = acc.paths, acc.bonus
        # the nodes' results only where a guess needs them (a decided step's are computed on first use)
        logits = fwd.logits if k and any(t is None for t in acc.top) else None
        guesses = next_guesses(logits, paths, bonus, acc.top, k)
        clock.lap("verify_s")
        self.kv.commit([[cols + n for n in p] for p in paths])
        clock.lap("commit_s")
        streaks = self.policy.observe(active, plan, paths, timings, acc.outputs)
        clock.lap("draft_s")  # the policy's host work: planning the step and learning from it
        for s, tree, p, tok, g, streak in zip(active, trees, paths, bonus, guesses, streaks):
            s.guesses, s.streak = g, streak
            tokens = [int(tree.tokens[n]) for n in p[1:]] + [tok]
            emitted = s.emit(tokens, self.parts.eos_ids, self.parts.tokenizer)
            s.stats.add_step(emitted, retrieved=tree.retrieved, tree_size=len(tree) - 1, **clock.times)
            if len(p) > 1:
                # the emitted drafts
                s.stats.count_origins([tree.origin_name(n, s.source_names) for n in p[1:emitted + 1]])
        return beside

    def _result(self, seq: DecodingSequence) -> GenerationResult:
        """A finished sequence's result; its answer joins the history source."""
        if self.parts.history is not None:
            self.parts.history.add(seq.out)
        return seq.result(self.parts.tokenizer)
