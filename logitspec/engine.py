"""The decoding loop: continuous batching of sequences, each with its own draft tree per step.

Per step: draft a tree per active sequence -> pack all trees into one forward (tree masks,
positions) -> verify each sequence's tree -> commit the accepted path's KV -> emit tokens.
The root of each tree is the last emitted token (not yet in the cache); the logits at the last
accepted node pick the next root (the bonus token) and, for LogitSpec, its next-next guesses.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from . import calibrate
from .budget import (N_STREAK_STATES, AcceptanceStats, CostCurve, choose_sizes, drain_weights, estimate, streak_state,
                     top_nodes)
from .cache import BatchKV
from .config import SpecConfig
from .draft import LOOKUP_KINDS, N_KINDS, make_drafter
from .feedback import Realised
from .head import NodeLogits
from .index import NgramSource, SequenceIndex, SiblingSource
from .masks import StepRow
from .prefix_cache import PrefixCache
from .session import FILL_CHUNK, Session
from .stats import SequenceStats
from .step_clock import StepClock
from .stops import eos_ids, stop_cut
from .target import ForwardResult, TargetForward
from .tree import DraftTree
from .sampling import draw, tree_uniforms, walk
from .request import Request, SamplingParams, per_prompt_requests
from .verify import decide

log = logging.getLogger("logitspec.engine")
# while the auto budget chooses no draft nodes, drafts are built (and the choice re-made) only on
# every RECHECK_EVERY-th step: the choice rests on acceptance rates and streaks that do not change
# without verified drafts, so the steps between would almost surely choose none again
RECHECK_EVERY = 4
MAX_RECHECK_EVERY = 16
SKIP_DRAFT_SHARE = 0.03  # ... when drafting and verifying took at least this share of a drafting step's time
DRAFT_MARGIN = 0.1  # at batch, drafting must promise this much more than plain decoding (estimates err)
RATE_STEPS = 8  # a draining batch estimates each row's steps left from its tokens per step over this many steps


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    request_id: int = 0  # the prompt's index in run() / its id from Session.submit
    sample_index: int = 0  # which of the prompt's n samples


@dataclass
class EngineRun:
    """What one :meth:`Engine.run` call produced."""

    results: list[GenerationResult]  # prompt-major: prompt 0's samples 0..n-1, then prompt 1's, ...
    stats: dict[str, float]  # wall_s, tokens, tokens_per_s, batch_steps, mean_active, ... (see docs/engine.md)


@dataclass
class _Sequence:
    """Decoding state of one request."""

    key: tuple[int, int]  # (request id, sample index)
    prompt_len: int
    max_new: int
    index: SequenceIndex  # prompt + emitted tokens; the last one is the root (not yet cached)
    sources: list[NgramSource]
    source_names: list[str]  # per source: one of stats.ORIGINS but "guess" (SequenceStats.accepted_from)
    generator: torch.Generator | None
    stats: SequenceStats
    stops: list[str] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    guesses: list[int] = field(default_factory=list)
    finish: str | None = None
    streak: int = 0  # the acceptance-rate state: budget.streak_state of its previous step's accepted drafts


class Engine:
    """Speculative (or plain) decoding of many prompts with one model replica."""

    def __init__(self, model, tokenizer=None, config: SpecConfig | None = None, *, prefill_chunk: int = 512,
                 fill_chunk: int | None = None, fast_head: bool = True, cost_curve: CostCurve | None = None, sample_on_host: bool | None = None,
                 prefix_cache: PrefixCache | None = None, screened_sampling: bool = True,
                 history: NgramSource | None = None):
        """``prefill_chunk``: prompt tokens per prefill forward (while other rows decode, one chunk's
        worth per decoding step). ``fill_chunk``: prompt tokens per forward of short prompts
        prefilled together while no row decodes (a batch filling up; default the larger of
        ``prefill_chunk`` and ``FILL_CHUNK``). ``prefix_cache``: prefilled prompts kept for reuse, shareable
        between engines over this model. ``cost_curve``: forward time per new-token count for
        ``budget="auto"``; by default loaded from ``logitspec calibrate``'s store or measured quickly
        on first use. ``sample_on_host``: walk sampled trees on the host, computing distributions
        only at visited nodes (default: on CPU); False samples every node where the logits are and
        waits for the device once a step. ``screened_sampling``: the host walk draws from the greedy
        screen's half-precision scores, float32 logits only where its bound cannot decide
        (:mod:`logitspec.sampling`); False draws from full float32 rows (the same distribution, other
        draws for a seed; slower). ``history``: a :class:`~logitspec.history.HistorySource` fed with
        every finished row's answer and consulted after the row's own context and its reference."""
        self.model = model
        self.target = TargetForward(model, fast_head=fast_head)
        self.sample_on_host = self.target.device.type == "cpu" if sample_on_host is None else sample_on_host
        self.screened_sampling = screened_sampling
        self.history = history
        self.tokenizer = tokenizer
        self.config = config or SpecConfig()
        self.drafter = make_drafter(self.config)
        if prefill_chunk < 1 or (fill_chunk is not None and fill_chunk < 1):
            raise ValueError(f"prefill_chunk and fill_chunk must be >= 1, got {prefill_chunk}, {fill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.fill_chunk = max(prefill_chunk, FILL_CHUNK) if fill_chunk is None else fill_chunk
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.bind(model)
        self.max_context = self.target.max_context
        self.eos_ids = eos_ids(model, tokenizer)
        # State that persists across generate() calls (the engine learns as a long-running job would):
        # acceptance rates per node kind, the draft-free step count, the cost curve.
        # Retrieved continuations start optimistic (offline replays accepted most of them), more so
        # right after a step that accepted 4 or more drafted tokens (inside a copied span the copy
        # goes on: a fresh engine verifies whole chains there, as PLD does); logit guesses start at
        # 1/4; all are then learned from every verified node.
        priors = {k: (3.0, 1.0) for k in LOOKUP_KINDS}
        priors.update({(streak_state(n), k): (9.0, 1.0) for n in (4, 8) for k in LOOKUP_KINDS})
        self.acceptance = AcceptanceStats(N_KINDS, kind_priors=priors, n_states=N_STREAK_STATES)
        self._steps_without_drafts = 0
        self._recheck_every = RECHECK_EVERY  # steps between re-checks while no drafts are chosen (see _draft)
        self._draft_share = 1.0  # drafting's share of the last drafting step's time (see _draft)
        # a host-timed value -> the value every rank of a tensor-parallel group uses (rank 0's, see
        # distributed.make_engine); decisions taken from timings must not differ between ranks
        self.agree_on = float
        self._drafted = True  # whether the current step drafted
        self.cost_curve = cost_curve
        self.auto_budget = self.config.method == "logitspec" and self.config.budget == "auto"
        self.realised = Realised()  # the budget's estimates against what steps delivered (logitspec.feedback)
        self._expected: tuple[float, float] | None = None  # this step's (drafted tokens, curve seconds)

    # ------------------------------------------------------------------ input
    def encode(self, prompt, apply_chat_template: bool = False) -> list[int]:
        """Token ids of one prompt (a string, a list of chat messages, or token ids); ValueError if unusable."""
        if prompt is None:
            raise ValueError("prompt is None")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError("empty prompt")
            if apply_chat_template or not isinstance(prompt, str):
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("the tokenizer has no chat template")
                msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
                ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
            ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
            vocab = self.model.config.get_text_config(decoder=True).vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab})")
        else:
            raise ValueError(f"a prompt must be a string, chat messages or token ids, not {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_context}")
        return list(ids)

    # ------------------------------------------------------------------ api
    def generate(self, prompts: Sequence, request: Request | Sequence[Request] | None = None,
                 **kwargs) -> list[GenerationResult]:
        """Generate for every prompt; results in input order. Arguments as :meth:`run`."""
        return self.run(prompts, request, **kwargs).results

    def open(self, defaults: Request | None = None, *legacy, apply_chat_template: bool = False, seed: int = 0,
             **old) -> Session:
        """A :class:`~logitspec.session.Session`: ``submit`` prompts at any time (each with its own
        :class:`~logitspec.request.Request`, ``defaults`` where it has none), ``step`` to advance the
        batch and collect finished results. ``seed``: the session's base seed (a request without one
        is seeded ``seed`` + its request id).

        Transitional: the old settings (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
        ``seed``, ``stop``, positional or by keyword) are still accepted and make ``defaults``."""
        if legacy or old or (defaults is not None and not isinstance(defaults, Request)):
            names = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "apply_chat_template")
            given = dict(zip(names, (defaults, *legacy)), **old)
            seed = int(given.pop("seed", seed) or 0)
            apply_chat_template = bool(given.pop("apply_chat_template", apply_chat_template))
            defaults = Request(**{k: v for k, v in given.items() if v is not None})
        return Session(self, defaults or Request(), seed, apply_chat_template)

    @torch.inference_mode()
    def run(self, prompts: Sequence, request: Request | Sequence[Request] | None = None, *, reference=None,
            apply_chat_template: bool = False, **fields) -> EngineRun:
        """Generate every prompt's samples (one prefill each): results prompt-major, and the run's
        throughput figures.

        ``request``: the settings of every prompt, or one :class:`~logitspec.request.Request` per
        prompt; ``fields`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, and
        ``seed`` and ``n``: an int or one per prompt) override them. Seeds: an int ``seed`` (also a
        single request's) is a base, prompt i uses ``seed + i``; sample j of a prompt seeded s uses
        :func:`~logitspec.session.sample_seed` (s, j), which is s for j = 0. A sequence's samples
        depend only on its own seed and settings, never on which others share its batch.
        ``reference``: a shared n-gram source (e.g. a :class:`CorpusIndex`) consulted after the
        sequence's own context, or one per prompt.
        """
        t_start = time.perf_counter()
        prompts = list(prompts)
        requests, base = per_prompt_requests(len(prompts), request, fields)
        refs = reference if isinstance(reference, (list, tuple)) else [reference] * len(prompts)
        if len(refs) != len(prompts):
            raise ValueError("seed, reference and n lists must have one entry per prompt")
        session = self.open(requests[0] if requests else None, seed=base, apply_chat_template=apply_chat_template)
        for p, q, r in zip(prompts, requests, refs):  # all errors before any forward
            session.submit(p, q, reference=r)
        results = sorted(session.drain(), key=lambda r: (r.request_id, r.sample_index))
        wall = time.perf_counter() - t_start
        ntok = sum(len(r.token_ids) for r in results)
        stats = {"wall_s": wall, "tokens": ntok, "tokens_per_s": ntok / wall if wall else 0.0, **session.stats,
                 "max_step_gap_s": max((r.stats["max_step_gap_s"] for r in results), default=0.0)}
        if self.prefix_cache is not None:
            stats.update({f"prefix_{k}": v for k, v in self.prefix_cache.stats.items()})
        if self.auto_budget:
            stats.update(self.realised.as_dict())
        return EngineRun(results, stats)

    # ------------------------------------------------------------------ loop parts (used by Session)
    def start_sequence(self, key: tuple[int, int], prompt_ids: list[int], max_new: int, seed: int, ref,
                       last: NodeLogits, params: SamplingParams, stops, siblings: list | None = None) -> _Sequence:
        """A sequence for a prefilled prompt, its first token picked from ``last`` (the final
        prompt token's output, [1, V]); the caller adds its KV row unless it already finished.
        ``siblings``: the list shared by the prompt's samples (see :class:`~logitspec.index.SiblingSource`),
        or None for a prompt sampled once."""
        c = self.config
        gen = None if params.greedy else torch.Generator().manual_seed(int(seed))
        seq = _Sequence(key=key, prompt_len=len(prompt_ids), max_new=max_new,
                        index=SequenceIndex(prompt_ids, c.max_ngram, c.min_ngram),
                        sources=[], source_names=[], generator=gen, stats=SequenceStats(), stops=stops)
        near = None
        if siblings is not None and c.sibling_drafts:
            siblings.append(seq.index)
            near = SiblingSource(siblings, seq.index)
        named = [(seq.index, "context"), (near, "siblings"), (ref, "reference"), (self.history, "history")]
        seq.sources = [src for src, _ in named if src is not None]
        seq.source_names = [name for src, name in named if src is not None]
        tok = self._pick(last, params, seq)  # last: the final prompt token's output, [1, V]
        seq.guesses = self._next_guesses([last], [[0]], [tok])[0]
        self._emit(seq, [tok], stops)
        seq.stats.add_step(1, retrieved=False)  # the prefill forward emits the first token
        return seq

    def decode_step(self, active: list[_Sequence], kv: BatchKV, params: SamplingParams,
                    draining: bool = False) -> None:
        """One decoding step of every active row (``kv`` row b is ``active[b]``'s). ``draining``: no
        prompt waits for a slot, so the batch ends with its slowest row (the budget weighs rows by
        what they have left: :func:`~logitspec.budget.drain_weights`)."""
        self._step(active, kv, params, draining)

    def _pick(self, logits: NodeLogits, params: SamplingParams, seq: _Sequence) -> int:
        """The next token after the one node whose output is ``logits``."""
        if params.greedy:
            return int(logits.argmax[0])
        return draw(logits, 0, params, seq.generator)

    def _exact(self, params: SamplingParams) -> bool:
        """Whether the step needs float32 rows of every node: sampling, unless the host walk draws
        from the screen (where there is none, the head gives float32 rows anyway)."""
        return not params.greedy and not (self.sample_on_host and self.screened_sampling)

    def output_mode(self, params: SamplingParams) -> tuple[bool, bool]:
        """The head's (``exact``, ``argmax``) flags for sequences sampled with ``params``."""
        return self._exact(params), params.greedy

    def _step(self, active: list[_Sequence], kv: BatchKV, params: SamplingParams,
              draining: bool = False) -> None:
        """One decoding step of every active row: draft -> target forward -> accept -> commit -> emit."""
        clock = StepClock()
        trees = self._draft(active, draining)
        rows = [StepRow.from_tree(len(s.index) - 1, tree) for s, tree in zip(active, trees)]
        clock.lap("draft_s")
        cols = kv.columns
        fwd = self.target(rows, kv, all_logits=True, exact=self._exact(params), argmax=params.greedy)  # n_b per row
        clock.lap("forward_s", pack_s=fwd.pack_s)  # on a GPU: queued; the wait for it falls into verify_s
        paths, bonus, guesses = self._accept(active, trees, fwd, params)
        clock.lap("verify_s")
        kv.commit([[cols + n for n in p] for p in paths])
        clock.lap("commit_s")
        if self._expected is not None:
            expected, curve_s = self._expected
            self.realised.of(len(active)).update(expected, sum(len(p) - 1 for p in paths), curve_s,
                                                 self.agree_on(sum(clock.times.values())))  # a timing: every TP rank the same
            self._expected = None
        if self._drafted:
            self._draft_share = self.agree_on(self._host_share(clock))
        for s, tree, p, tok, g in zip(active, trees, paths, bonus, guesses):
            s.guesses = g
            emitted = self._emit(s, [int(tree.tokens[n]) for n in p[1:]] + [tok], s.stops)
            s.stats.add_step(emitted, retrieved=tree.retrieved, tree_size=len(tree) - 1, **clock.times)
            if len(p) > 1:
                s.stats.count_origins([tree.origin_name(n, s.source_names) for n in p[1:emitted + 1]])  # the emitted drafts

    @staticmethod
    def _host_share(clock: StepClock) -> float:
        """Speculation's share of a drafting step's time: drafting, and verifying (acceptance, the
        guesses' top-k)."""
        return (clock.times["draft_s"] + clock.times["verify_s"]) / max(sum(clock.times.values()), 1e-9)

    def _draft(self, active: list[_Sequence], draining: bool = False) -> list[DraftTree]:
        """A draft tree per row, within the step's budget, the row's remaining tokens and the context.
        While the auto budget keeps choosing plain decoding and drafting (with verifying: the
        guesses' top-k) is a noticeable share of a step's time (``SKIP_DRAFT_SHARE``, e.g. many
        rows), only every ``RECHECK_EVERY``-th step drafts (to re-check; the interval doubles, up to
        ``MAX_RECHECK_EVERY``, each time the re-check chooses none again); the others skip drafting."""
        if self.auto_budget and self._steps_without_drafts % self._recheck_every and self._draft_share >= SKIP_DRAFT_SHARE:
            self._steps_without_drafts += 1
            self._drafted = False
            if self.cost_curve is not None:
                self._expected = (0.0, self.cost_curve.step(len(active), 1, self._columns(active)))
            return [DraftTree.single(s.index.tokens[-1]) for s in active]
        self._drafted = True
        budget = self.config.budget_for(self.drafter.base_budget(), len(active))
        trees = []
        for s in active:
            room = min(s.max_new - len(s.out), self.max_context - len(s.index)) - 1
            trees.append(self.drafter.draft(s.sources, s.index.tokens, s.guesses, max(0, min(budget, room))))
        if self.auto_budget:
            trees = self._prune(trees, active, draining)
        return trees

    def _accept(self, active: list[_Sequence], trees: list[DraftTree], fwd: ForwardResult,
                params: SamplingParams) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """Per row: the accepted node path (root first), the bonus token after it and the next
        step's guesses; the acceptance rates learn from every verified node. Sampling on the host
        walks each tree drawing only at the nodes it visits; otherwise all rows are decided where
        the logits are, with one transfer to the host (:func:`~logitspec.verify.decide`)."""
        if params.greedy or not self.sample_on_host:
            paths, bonus, top = self._decide(active, trees, fwd, params)
        else:
            picks = [walk(t, lg, params, s.generator) for s, t, lg in zip(active, trees, fwd.logits)]
            paths, bonus, top = [p for p, _ in picks], [b for _, b in picks], None
        for s, tree, path in zip(active, trees, paths):
            self.acceptance.update(tree, path, s.streak)
            s.streak = streak_state(len(path) - 1)
        return paths, bonus, self._next_guesses(fwd.logits, paths, bonus, top)

    def _want_guesses(self) -> bool:
        """Whether the next step can use next-next guesses from this one: not when it will skip
        drafting (:meth:`_draft`), so their top-k over the vocabulary is not computed for nothing.
        A drafting step always computes them, so the draft share it measures includes them."""
        return self._drafted or not self._steps_without_drafts % self._recheck_every

    def _decide(self, active: list[_Sequence], trees: list[DraftTree], fwd: ForwardResult, params: SamplingParams):
        """:func:`~logitspec.verify.decide` for the step: paths, bonus tokens, top tokens (or None)."""
        k = self.config.top_k if self.drafter.wants_guesses and self._want_guesses() else 0
        u, states = (None, None) if params.greedy else tree_uniforms([s.generator for s in active], trees,
                                                                      self.target.device)
        d = decide(fwd.nodes, fwd.packed, fwd.select, fwd.starts, params, u, k)
        paths = [tree.path_to(last) for tree, last in zip(trees, d.last)]
        for s, st, path in zip(active, states or [], paths):
            s.generator.set_state(st[len(path)])  # one uniform consumed per emitted token
        return paths, d.bonus, d.top if k else None

    def _next_guesses(self, logits: list[NodeLogits], paths: list[list[int]], bonus: list[int],
                      top: list[list[int]] | None = None) -> list[list[int]]:
        """Per row, the next step's next-next guesses: the top-k of the last accepted node's scores
        (which chose the bonus token, excluded); ``top``: those top-k + 1 tokens when known."""
        k = self.config.top_k
        if not self.drafter.wants_guesses or k == 0 or not self._want_guesses():
            return [[] for _ in paths]
        if top is None:
            last = torch.stack([lg.scores[p[-1]] for lg, p in zip(logits, paths)])  # [B, V]
            top = torch.topk(last, k + 1, dim=-1).indices.tolist()  # [B][k + 1]
        return [[t for t in row if t != b][:k] for row, b in zip(top, bonus)]

    def _prune(self, trees: list, active: list[_Sequence], draining: bool) -> list:
        """Keep per tree the nodes worth their forward time (see :mod:`logitspec.budget`); a
        ``draining`` batch weighs its rows' tokens by :func:`~logitspec.budget.drain_weights`."""
        fresh = self.cost_curve is None  # measured in this step's time: not a step to learn from
        if fresh:
            self.cost_curve = calibrate.load_or_measure(self.target, self.config.max_batch_size)
        weights, base, B = None, None, len(active)
        if draining and B > 1:  # tokens worth what they save of the batch's time (budget.drain_weights)
            step = self.cost_curve.step(B, 1)
            weights = drain_weights([s.max_new - len(s.out) for s in active],
                                    [np.mean(s.stats.accepted_lengths[-RATE_STEPS:] or [1]) for s in active],
                                    share=(step - self.cost_curve.step(B - 1, 1)) / step,
                                    end=self.cost_curve.step(1, 1) / step)
            base = 1.0
        probs = [self.acceptance.node_probs(t, s.streak) for t, s in zip(trees, active)]
        most = max(len(t) - 1 for t in trees)
        columns = self._columns(active)
        ranked = [np.sort(p[1:])[::-1] for p in probs]
        fix = self.realised.of(B)
        sizes = choose_sizes(ranked, self.cost_curve, most, weights, margin=DRAFT_MARGIN if B > 1 else 0.0,
                             columns=columns, token_scale=fix.tokens, cost_scale=fix.cost, base=base)
        # explore: rates are learned only from verified nodes, so after 16 draft-free steps per row
        # (an exploring step at batch B verifies B rows) verify a couple of nodes once, or a
        # pessimistic estimate could never recover
        self._steps_without_drafts = self._steps_without_drafts + 1 if not any(sizes) else 0
        self._recheck_every = min(2 * self._recheck_every, MAX_RECHECK_EVERY) if not any(sizes) else RECHECK_EVERY
        if self._steps_without_drafts > 16 * len(trees):
            sizes, self._steps_without_drafts = [min(2, most)] * len(trees), 0
        self._expected = None if fresh else estimate(ranked, sizes, self.cost_curve, columns)
        return [top_nodes(t, p, n) for t, p, n in zip(trees, probs, sizes)]

    def _columns(self, active: list[_Sequence]) -> float:
        """The cached columns the rows' nodes read, averaged over layers (see CostCurve.step)."""
        return self.target.read_columns(float(np.mean([len(s.index) for s in active])))

    def _emit(self, seq: _Sequence, tokens: list[int], stops) -> int:
        """Append accepted tokens, stopping at EOS, a stop string or the length limit; returns
        how many were kept."""
        kept = []
        for t in tokens:
            kept.append(t)
            if t in self.eos_ids:
                seq.finish = "stop"
                break
            if len(seq.out) + len(kept) >= seq.max_new:
                seq.finish = "length"
                break
        if stops:
            before = len(seq.out)
            cut = stop_cut(self.tokenizer, seq.out + kept, before, stops)
            if cut is not None:
                kept = kept[: cut - before]
                seq.finish = "stop"
        seq.out.extend(kept)
        seq.index.extend(kept)
        return len(kept)

    def result(self, seq: _Sequence) -> GenerationResult:
        """The finished (or stopped) sequence's result."""
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.out, skip_special_tokens=True)
            for s in seq.stops:  # like vLLM: the stop string itself is not part of the text
                if s in text:
                    text = text[: text.index(s)]
        stats = seq.stats.as_dict()
        if self.history is not None:
            self.history.add(seq.out)
        prompt_ids = seq.index.tokens[:seq.prompt_len]
        return GenerationResult(seq.out, text, seq.finish or "length", stats, [int(t) for t in prompt_ids],
                                seq.key[0], seq.key[1])

