"""The speculation policy: what each row of a step drafts, and how much of it is worth verifying.

It holds what speculation learns across steps and calls: the drafter, the acceptance rates per node
kind (:class:`~logitspec.spec_decode.budget.AcceptanceStats`), the forward-cost curve, the budget's
corrections (:class:`~logitspec.spec_decode.feedback.Realised`) and the auto budget's state machine
(when a step skips drafting). It knows nothing of the model: a session hands it the rows
(:class:`DraftRow`) and gets the step's plan (:meth:`SpeculationPolicy.draft`: a :class:`StepPlan`,
the trees and what was decided with them), then hands the plan back with what the step verified and
how long it took (:meth:`SpeculationPolicy.observe`). Tests drive it with a hand-made cost curve and
rows.

The auto budget's state machine: while it keeps choosing no draft nodes and drafting (with
verifying: the guesses' top-k) is a noticeable share of a step's time (``SKIP_DRAFT_SHARE``), only
every ``RECHECK_EVERY``-th step drafts, to re-check (the interval doubles, up to
``MAX_RECHECK_EVERY``, each time the re-check chooses none again); the others skip drafting.

Rates are learned only from verified nodes, so a pessimistic estimate could never recover; two
checks from :mod:`~logitspec.spec_decode.evidence` sit on top. Where the budget chose no nodes for
a row but the evidence that its drafts do not pay is not sound (the first-node acceptance interval
of the draft's kind reaches the break-even rate; counts decay, so evidence ages), the row verifies
its first node (a probe); and a speed guard interleaves steps that may draft with plain steps and
turns drafting off only when the measured tokens per second say plain decoding is faster.
"""
from __future__ import annotations

import collections
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from logitspec.config import SpecConfig
from logitspec.spec_decode.budget import (
    N_STREAK_STATES,
    AcceptanceStats,
    CostCurve,
    Verified,
    break_even,
    choose_sizes,
    drain_weights,
    estimate,
    kept_nodes,
    streak_state,
)
from logitspec.spec_decode.drafters import make_drafter
from logitspec.spec_decode.evidence import FirstNodeEvidence, SpeedGuard
from logitspec.spec_decode.feedback import Realised
from logitspec.spec_decode.interface import IS_LOOKUP, KINDS, LOOKUP_KINDS, N_KINDS, Drafter
from logitspec.spec_decode.ngram_index import NgramSource
from logitspec.spec_decode.tree import DraftTree

log = logging.getLogger("logitspec.spec_decode.policy")

# while the auto budget chooses no draft nodes, drafts are built (and the choice re-made) only on
# every RECHECK_EVERY-th step: the choice rests on acceptance rates and streaks that do not change
# without verified drafts, so the steps between would almost surely choose none again
RECHECK_EVERY = 4
MAX_RECHECK_EVERY = 16
SKIP_DRAFT_SHARE = 0.03  # ... when drafting and verifying took at least this share of a drafting step's time
DRAFT_MARGIN = 0.1  # at batch, drafting must promise this much more than plain decoding (estimates err)
BUDGETED = ("pld", "rest", "logitspec")  # the methods the auto budget cuts
# a cost curve whose plain step is this far (either way) from the median forward time of this run's
# last STALE_STEPS plain steps is stale (measured while the machine ran at another speed, 15x seen):
# measured again, at most MAX_REMEASURES times in an engine's life
STALE_FACTOR = 2.0
STALE_STEPS = 16
MAX_REMEASURES = 2


def uses_auto_budget(config: SpecConfig) -> bool:
    """Whether an engine of ``config`` sizes its trees from a measured cost curve (the auto budget)."""
    return config.budget == "auto" and config.method in BUDGETED


# per row of a step, the node to accept instead of the acceptance rule's
AcceptOverride = Callable[[Sequence[DraftTree]], list[int]]
# after each decoding step: (rows, trees, accepted node paths)
StepObserver = Callable[[Sequence[Any], Sequence[DraftTree], Sequence[Sequence[int]]], None]


class DraftRow(Protocol):
    """What drafting reads of a row (:class:`~logitspec.engine.sequence.DecodingSequence` is one)."""

    sources: list[NgramSource]  # n-gram sources, best first
    guesses: list[int]  # next-next guesses from the last verified node's scores
    streak: int  # acceptance-rate state after its previous step (budget.streak_state)
    draft_state: Any  # the drafter's state for the row (new_state; read only when the drafter keeps one)

    @property
    def tokens(self) -> Sequence[int]: ...  # context; the last token is the tree's root

    @property
    def length(self) -> int: ...  # context tokens (the root included)

    @property
    def remaining(self) -> int: ...  # tokens it may still emit

    @property
    def drafted_rate(self) -> float: ...  # tokens per step over its recent steps that drafted


@dataclass(frozen=True)
class StepPlan:
    """What :meth:`SpeculationPolicy.draft` decided for one step; the session verifies its trees and
    hands it back to :meth:`SpeculationPolicy.observe` with the result (nothing else about the step is
    kept between the two calls)."""

    trees: list[DraftTree]  # per row, the tree to verify (the root alone: a plain step for the row)
    guesses: int  # next-next guesses the step's verification computes for the next step's drafts
    drafted: bool = True  # whether the drafter ran (False: the auto budget skipped drafting)
    mode: str = "draft"  # the speed guard's mode for the step ("draft": the budget decided; "plain")
    expected: tuple[float, float] | None = None  # the budget's (accepted drafted tokens, curve seconds)
    columns: float = 0.0  # cached columns the rows' nodes read, averaged over layers (the auto budget's)


class SpeculationPolicy:
    """Draft trees per step, sized by the budget, learning from every verified step."""

    def __init__(self, config: SpecConfig, *, max_context: int, read_columns: Callable[[float], float],
                 cost_curve: CostCurve | None = None, measure_curve: Callable[[], CostCurve] | None = None,
                 agree_on: Callable[[dict], dict] = dict, drafter: Drafter | None = None,
                 accept_override: AcceptOverride | None = None, step_observer: StepObserver | None = None,
                 remeasure_curve: Callable[[], CostCurve] | None = None):
        """``max_context``: the model's context (no tree grows past it). ``read_columns``: cached
        columns a node's attention reads with n in its row (the model runner's). ``cost_curve``:
        forward seconds per new-token count for ``budget="auto"``; without one, ``measure_curve()``
        gives it on first need (e.g. loaded from ``logitspec calibrate``'s store or measured).
        ``agree_on``: a step's timings -> the timings every rank of a tensor-parallel group uses
        (rank 0's: :func:`~logitspec.engine.tensor_parallel.rank0_times`): the one place a decision reads
        a clock (:meth:`observe`), so decisions taken from timings never differ between ranks.
        ``drafter``: the drafter (default the method's, :func:`make_drafter`).
        ``accept_override``: per row of a step, the node to accept instead of the rule's (greedy rows
        only). ``step_observer``: called after each step with (rows, trees, accepted paths). The
        benchmark tools replay and record acceptance traces through these three.
        ``remeasure_curve``: a fresh measurement of the curve, taken when this run's plain steps show
        the curve stale (``STALE_FACTOR``; None: never, e.g. a tensor-parallel group's curve)."""
        self.config = config
        self.drafter = make_drafter(config) if drafter is None else drafter
        self._accept_override, self.step_observer = accept_override, step_observer
        self.max_context = max_context
        self.read_columns = read_columns
        self.cost_curve = cost_curve
        self.measure_curve = measure_curve
        self.agree_on = agree_on
        # every drafting method whose tree can be cut (lookahead's has a fixed shape) is budgeted alike
        self.auto_budget = uses_auto_budget(config)
        # Retrieved continuations start optimistic (offline replays accepted most of them), more so
        # right after a step that accepted 4 or more drafted tokens (inside a copied span the copy
        # goes on: a fresh engine verifies whole chains there, as PLD does); logit guesses start at
        # 1/4; all are then learned from every verified node.
        priors = {k: (3.0, 1.0) for k in LOOKUP_KINDS}
        priors.update({(streak_state(n), k): (9.0, 1.0) for n in (4, 8) for k in LOOKUP_KINDS})
        self.acceptance = AcceptanceStats(N_KINDS, kind_priors=priors, n_states=N_STREAK_STATES)
        self.realised = Realised()  # the budget's estimates against what steps delivered
        self.evidence = FirstNodeEvidence(N_STREAK_STATES, N_KINDS)  # first-node acceptance, with intervals
        self.guard = SpeedGuard()  # drafting steps against plain ones, by the clock
        self.probes = 0  # rows whose first node was verified only for evidence
        self.steps_without_drafts = 0
        self.recheck_every = RECHECK_EVERY  # steps between re-checks while no drafts are chosen
        self.draft_share = 1.0  # drafting's share of the last drafting step's time
        self.drafted = True  # whether the last step drafted
        self.remeasure_curve = remeasure_curve
        self.remeasures = 0
        self._plain_ratios: collections.deque = collections.deque(maxlen=STALE_STEPS)  # forward / curve

    # ------------------------------------------------------------------ per step
    def draft(self, rows: Sequence[DraftRow], draining: bool = False) -> StepPlan:
        """The step's plan: a draft tree per row, within the step's budget, the row's remaining tokens
        and the context (see the module for when a step skips drafting). ``draining``: no prompt waits
        for a slot, so the batch ends with its slowest row (the budget weighs rows by what they have
        left: :func:`~logitspec.spec_decode.budget.drain_weights`)."""
        mode, columns = "draft", 0.0
        if self.auto_budget:
            self.evidence.age()
            mode = self.guard.mode(len(rows))
            columns = self.read_columns(sum(r.length for r in rows) / max(len(rows), 1))
        if self.auto_budget and (mode == "plain" or self.steps_without_drafts % self.recheck_every
                                 and self.draft_share >= SKIP_DRAFT_SHARE):
            self.steps_without_drafts += mode == "draft"
            self.drafted = False
            expected = None if self.cost_curve is None else (0.0, self.cost_curve.step(len(rows), 1, columns))
            return StepPlan([DraftTree.single(r.tokens[-1]) for r in rows], self.guess_count, False, mode,
                            expected, columns)
        self.drafted = True
        stateful, fixed = self.drafter.keeps_state, self.drafter.fixed_shape
        # a fixed-shape tree (lookahead's W, N, G) is the method's at any batch size
        base = self.drafter.base_budget()
        budget = base if fixed else self.config.budget_for(base, len(rows))
        trees = []
        for r in rows:
            room = self.max_context - r.length  # a fixed-shape tree may outgrow the tokens left
            room = (room if fixed else min(r.remaining, room)) - 1
            trees.append(self.drafter.draft(r.sources, r.tokens, r.guesses, max(0, min(budget, room)),
                                            r.draft_state if stateful else None))
        expected = None
        if self.auto_budget:
            trees, expected = self._prune(trees, rows, draining, columns)
        return StepPlan(trees, self.guess_count, True, mode, expected, columns)

    @property
    def guess_count(self) -> int:
        """Next-next guesses the next step can use from the last verified nodes (a prefill's, or the
        step just planned: :attr:`StepPlan.guesses`): none when it will skip drafting, so their
        top-k over the vocabulary is not computed for nothing. A drafting step always computes them,
        so the draft share it measures includes them."""
        if not self.drafter.wants_guesses:
            return 0
        return self.config.top_k if self.drafted or not self.steps_without_drafts % self.recheck_every else 0

    def new_state(self, prompt: Sequence[int]) -> Any:
        """A new row's drafting state (the row keeps it as its ``draft_state``; None for most drafters)."""
        return self.drafter.new_state(prompt)

    @property
    def wants_node_outputs(self) -> bool:
        """Whether :meth:`observe` needs the target's token after every node (lookahead's window)."""
        return self.drafter.wants_node_outputs

    def accept_override(self, trees: Sequence[DraftTree]) -> list[int] | None:
        """Per row the node to accept instead of the acceptance rule's (None: the rule decides)."""
        return None if self._accept_override is None else self._accept_override(trees)

    def observe(self, rows: Sequence[DraftRow], plan: StepPlan, paths: Sequence[Sequence[int]],
                times: dict[str, float] | None, outputs: Sequence[Sequence[int]] | None = None) -> list[int]:
        """Learn from a verified step: per row (its acceptance ``streak`` before the step and its
        ``draft_state``) its tree (``plan``'s, from :meth:`draft`) and accepted node path (root first);
        ``times``: the step's parts in seconds (``draft_s``, ``forward_s``, ``verify_s``, ``commit_s``;
        None where the step's time is not its own, e.g. a prefill ran beside it: nothing is learned
        from it); where :attr:`wants_node_outputs`, per row the target's token after each node
        (``outputs``). Returns each row's acceptance state after it."""
        trees = plan.trees
        if self.auto_budget:  # (only the auto budget reads the rates)
            verified = Verified.of(trees, paths, [row.streak for row in rows])
            self.acceptance.update_step(verified)
            self.evidence.update_step(verified)
        plain = all(len(t) == 1 for t in trees)
        known = times is not None  # None: the step's time is not its own (it hid other work)
        check = (known and plain and self.auto_budget and self.remeasure_curve is not None
                 and self.cost_curve is not None)
        # the step's timings as the group agreed on them (one collective under tensor parallelism, only
        # where a decision reads them; a fixed budget never): no decision below reads ``times`` itself
        timed = known and self.auto_budget and (self.cost_curve is not None or plan.drafted)
        agreed = self.agree_on(times) if timed or check else None
        seconds = None  # the step's time, the same on every TP rank
        if timed and self.cost_curve is not None:  # (a step with expectations has a curve)
            seconds = sum(agreed.values())
            B = len(trees)
            self.guard.record(B, plan.mode, sum(len(p) for p in paths), seconds,
                              plain_s=self.cost_curve.step(B, 1))
        if outputs is not None:
            for row, tree, path, out in zip(rows, trees, paths, outputs):
                self.drafter.observe(row.draft_state, tree, path, out)
        if self.step_observer is not None:
            self.step_observer(rows, trees, paths)
        if plan.expected is not None and seconds is not None:
            expected, curve_s = plan.expected
            accepted = sum(len(p) - 1 for p in paths)
            self.realised.of(len(trees)).update(expected, accepted, curve_s, seconds)
        if timed and plan.drafted:  # (only the auto budget's skips read it)
            self.draft_share = host_share(agreed)
        if check:
            self._check_curve(len(trees), agreed["forward_s"], plan.columns)
        return [streak_state(len(p) - 1) for p in paths]

    def _check_curve(self, rows: int, forward_s: float, columns: float) -> None:
        """A plain step's forward time against the curve's; a stale curve (see ``STALE_FACTOR``) is
        measured again, and what was learned relative to it (corrections, the speed guard) restarts."""
        self._plain_ratios.append(forward_s / max(self.cost_curve.step(rows, 1, columns), 1e-12))
        if len(self._plain_ratios) < STALE_STEPS or self.remeasures >= MAX_REMEASURES:
            return
        ratio = statistics.median(self._plain_ratios)  # (numpy's costs 30x more on 16 values)
        if 1 / STALE_FACTOR <= ratio <= STALE_FACTOR:
            return
        self.remeasures += 1
        log.warning("the forward cost curve is stale: this run's plain steps took %.2fx its time (median of "
                    "%d); measuring it again (%d of at most %d)", ratio, STALE_STEPS, self.remeasures,
                    MAX_REMEASURES)
        self.cost_curve = self.remeasure_curve()
        self._plain_ratios.clear()
        self.realised, self.guard = Realised(), SpeedGuard()

    def stats(self) -> dict[str, float]:
        """The budget's corrections so far (none unless the budget is auto)."""
        return self.realised.as_dict() if self.auto_budget else {}

    def evidence_summary(self, rows: int = 1) -> dict:
        """What the auto budget decides from (empty unless the budget is auto): per draft kind the
        first nodes tested (decayed counts), their acceptance and its interval; the break-even rate
        at ``rows`` rows (with the learned cost correction); the rows probed; the speed guard's
        per-class verdict and tokens/s."""
        if not self.auto_budget:
            return {}
        be = (break_even(self.cost_curve, rows, self.realised.of(rows).cost) if self.cost_curve is not None
              else None)
        return {"first_nodes": self.evidence.summary(dict(enumerate(KINDS))), "break_even": be, "rows": rows,
                "probes": self.probes, "speed": self.guard.summary()}

    # ------------------------------------------------------------------ the auto budget
    def curve(self) -> CostCurve:
        """The cost curve the budget sizes trees from: the one given, else ``measure_curve()``'s, on
        first need."""
        if self.cost_curve is None:
            self.cost_curve = self.measure_curve()
        return self.cost_curve

    def _prune(self, trees: list[DraftTree], rows: Sequence[DraftRow], draining: bool,
               columns: float) -> tuple[list[DraftTree], tuple[float, float] | None]:
        """Keep per tree the nodes worth their forward time (see :mod:`logitspec.spec_decode.budget`); a
        ``draining`` batch weighs its rows' tokens by :func:`~logitspec.spec_decode.budget.drain_weights`.
        ``columns``: what the rows' nodes read (:attr:`StepPlan.columns`). With the kept trees, what the
        budget expects of them (:attr:`StepPlan.expected`; None right after the curve was measured)."""
        fresh = self.cost_curve is None  # measured in this step's time: not a step to learn from
        curve, B = self.curve(), len(rows)
        weights, base = None, None
        if draining and B > 1:  # tokens worth what they save of the batch's time (budget.drain_weights)
            step = curve.step(B, 1)
            weights = drain_weights([r.remaining for r in rows], [r.drafted_rate for r in rows],
                                    share=(step - curve.step(B - 1, 1)) / step,
                                    end=lambda k: curve.step(k, 1) / step)
            base = 1.0
        probs = [self.acceptance.node_probs(t, r.streak) for t, r in zip(trees, rows)]
        most = max(len(t) - 1 for t in trees)
        ranked = [np.sort(p[1:])[::-1] for p in probs]
        fix = self.realised.of(B)

        def choose(values: list[np.ndarray]) -> list[int]:
            return choose_sizes(values, curve, most, weights, margin=DRAFT_MARGIN if B > 1 else 0.0,
                                columns=columns, token_scale=fix.tokens, cost_scale=fix.cost, base=base)

        sizes = choose(ranked)
        be = break_even(curve, B, fix.cost)
        # a draining batch's row is worth its weight in a step (of B rows' tokens at weight 1 / B each):
        # a row whose tokens save nothing of the batch's time is never probed
        bes = [be] * B if weights is None else [be / max(B * w, 1e-12) for w in weights]
        sizes = self._probe(sizes, trees, rows, bes)
        # trees of retrieved chains and guesses: the chains keep at least what the same choice over the
        # chains alone (pld's tree) keeps; guesses take only the nodes that pay beyond them
        chained = [IS_LOOKUP[t.kinds] for t in trees] if self.drafter.wants_guesses else None
        floors = [0] * B
        if chained is not None and any(c.any() and not c[1:].all() for c in chained):
            floors = self._probe(choose([np.sort(p[c])[::-1] for p, c in zip(probs, chained)]), trees, rows,
                                 bes, chained)
        keep = [kept_nodes(p, n, f, c) for p, n, f, c in zip(probs, sizes, floors, chained or [None] * B)]
        self._after_choice([len(k) for k in keep])
        expected = None if fresh else estimate([p[k] for p, k in zip(probs, keep)], [len(k) for k in keep],
                                               curve, columns)
        return [t if len(k) == len(t) - 1 else t.subtree(k) for t, k in zip(trees, keep)], expected

    def _probe(self, sizes: list[int], trees: Sequence[DraftTree], rows: Sequence[DraftRow],
               break_evens: Sequence[float], among: Sequence[np.ndarray] | None = None) -> list[int]:
        """One node for each row the budget gave none whose drafts (those ``among`` marks: all without
        it) are not soundly shown to fall short of its break-even acceptance
        (:meth:`FirstNodeEvidence.unsound`); only the drafts' probes are counted."""
        out = list(sizes)
        for b, (n, tree, row, be) in enumerate(zip(sizes, trees, rows, break_evens)):
            nodes = among[b] if among is not None else None
            if n == 0 and len(tree) > 1 and be <= 1.0 and self.evidence.unsound(tree, row.streak, be, nodes):
                out[b] = 1
                self.probes += among is None
        return out

    def _after_choice(self, sizes: list[int]) -> None:
        """The state machine's step after the budget chose ``sizes``: count draft-free steps, widen
        or reset the re-check interval."""
        none = not any(sizes)
        self.steps_without_drafts = self.steps_without_drafts + 1 if none else 0
        self.recheck_every = min(2 * self.recheck_every, MAX_RECHECK_EVERY) if none else RECHECK_EVERY


def host_share(times: dict[str, float]) -> float:
    """Speculation's share of a drafting step's time: drafting, and verifying (acceptance, the
    guesses' top-k)."""
    return (times["draft_s"] + times["verify_s"]) / max(sum(times.values()), 1e-9)
