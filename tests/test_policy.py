"""The speculation policy without a model: hand-made rows, cost curves and verified paths drive its
budget and its state machine (when it drafts, skips drafting and re-checks)."""
from dataclasses import dataclass, field

import numpy as np
import pytest

from logitspec.config import SpecConfig
from logitspec.spec_decode import policy as policy_module
from logitspec.spec_decode.budget import CostCurve
from logitspec.spec_decode.interface import LOOKUP_KINDS
from logitspec.spec_decode.ngram_index import SequenceIndex
from logitspec.spec_decode.policy import RECHECK_EVERY, SpeculationPolicy

STEEP = CostCurve([1, 64], [1.0, 631.0])  # every drafted node costs ten plain steps: trees never pay
FREE = CostCurve([1, 64], [1.0, 1.0])  # drafted nodes cost nothing: every tree pays
TIMES = {"draft_s": 1.0, "forward_s": 1.0, "verify_s": 0.0, "commit_s": 0.0}  # drafting: half a step


@dataclass
class Row:
    """What drafting reads of a row (logitspec.spec_decode.policy.DraftRow), made by hand."""

    tokens: list[int]
    guesses: list[int] = field(default_factory=list)
    streak: int = 0
    remaining: int = 100
    drafted_rate: float = 1.0

    def __post_init__(self):
        self.sources = [SequenceIndex(self.tokens, 3, 1)]

    @property
    def length(self) -> int:
        return len(self.tokens)


def _rows(n: int) -> list[Row]:
    return [Row([1, 2, 3, 4, 5] * 4 + [1, 2, 3][: 1 + b % 3]) for b in range(n)]


def _policy(curve: CostCurve, guard: bool = False, **config) -> SpeculationPolicy:
    """A policy on ``curve``; without ``guard`` its speed guard always lets the budget decide (the
    tests of the budget's own state machine; the guard has tests of its own)."""
    cfg = SpecConfig(**{"method": "logitspec", **config})
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=curve)
    if not guard:
        policy.guard.mode = lambda rows: "draft"
    return policy


def _run(policy: SpeculationPolicy, rows, steps: int):
    """Drive ``steps`` steps, nothing drafted ever accepted; per step whether the drafter ran and
    the draft nodes verified."""
    drafted, draft = [], policy.drafter.draft
    policy.drafter.draft = lambda *a: drafted.append(True) or draft(*a)
    log = []
    for _ in range(steps):
        n = len(drafted)
        plan = policy.draft(rows)
        trees = plan.trees
        log.append((len(drafted) > n, sum(len(t) - 1 for t in trees)))
        policy.observe(rows, plan, [[0]] * len(trees), TIMES)
    return log


def test_free_drafts_are_verified_and_learned_from():
    policy = _policy(FREE)
    rows = _rows(2)
    plan = policy.draft(rows)
    trees = plan.trees
    assert all(len(t) > 1 for t in trees) and policy.guess_count == policy.config.top_k
    before = policy.acceptance.tries.sum()
    streaks = policy.observe(rows, plan, [[0, 1]] * 2, TIMES)
    assert streaks == [1, 1] and policy.acceptance.tries.sum() > before
    assert policy.stats()  # the budget's corrections for 2 rows are reported


def test_trees_that_do_not_pay_are_not_verified():
    policy = _policy(STEEP)
    plan = policy.draft(_rows(1))
    trees = plan.trees
    assert [len(t) for t in trees] == [1]  # the root alone: plain decoding


def test_skipping_rechecks_on_schedule():
    """With trees that never pay (no acceptance rate reaches the break-even, so no probes either):
    the first step drafts and chooses none; then only every RECHECK_EVERY-th draft-free step drafts,
    the interval doubling up to MAX_RECHECK_EVERY; nothing is verified."""
    log = _run(_policy(STEEP), _rows(1), 60)
    drafting = [i for i, (d, _) in enumerate(log) if d]
    assert drafting == [0, 2 * RECHECK_EVERY, 16, 32, 48]
    assert not any(nodes for _, nodes in log)


def test_cheap_drafting_is_never_skipped(monkeypatch):
    """Drafting below SKIP_DRAFT_SHARE of a step's time: every step drafts (and chooses none)."""
    monkeypatch.setattr(policy_module, "SKIP_DRAFT_SHARE", 0.9)
    log = _run(_policy(STEEP), _rows(2), 12)
    assert all(d for d, _ in log)


def test_skipped_steps_compute_no_guesses():
    policy = _policy(STEEP)
    rows = _rows(1)
    policy.observe(rows, policy.draft(rows), [[0]], TIMES)  # drafts, chooses none: the next steps skip
    assert policy.draft(rows).trees[0].tokens.tolist() == [rows[0].tokens[-1]]
    assert policy.guess_count == 0


def test_ar_drafts_nothing_and_asks_for_no_guesses():
    policy = _policy(STEEP, method="ar", budget="auto")
    plan = policy.draft(_rows(1))
    trees = plan.trees
    assert policy.guess_count == 0 and [len(t) for t in trees] == [1]


def test_the_curve_is_measured_on_first_need_only():
    calls = []
    cfg = SpecConfig(method="logitspec")
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float,
                               measure_curve=lambda: calls.append(1) or FREE)
    rows = _rows(1)
    for _ in range(3):
        policy.observe(rows, policy.draft(rows), [[0]], TIMES)
    assert calls == [1] and policy.cost_curve is FREE


@pytest.mark.parametrize("method", ["pld", "rest", "logitspec"])
def test_every_drafting_method_is_cut_by_the_auto_budget_alike(method):
    """One budget for every method: with drafts that never pay each verifies the root alone, with free
    ones its whole tree; ``budget="fixed"`` keeps the whole tree whatever the curve."""
    rows = _rows(1)
    assert [len(t) for t in _policy(STEEP, method=method).draft(rows).trees] == [1]
    free = _policy(FREE, method=method).draft(rows).trees
    fixed = _policy(STEEP, method=method, budget="fixed").draft(rows).trees
    assert len(free[0]) > 1 and [len(t) for t in free] == [len(t) for t in fixed]
    assert _policy(FREE, method=method).auto_budget and not _policy(FREE, method="lookahead").auto_budget


@pytest.mark.parametrize("budget", ["auto", "fixed"])
def test_a_step_agrees_on_its_timings_once_and_a_fixed_budget_never(budget):
    """In a tensor-parallel group each ``agree_on`` is a collective: a step of the auto budget agrees
    on its timings once, a fixed budget on nothing."""
    calls = []
    cfg = SpecConfig(method="logitspec", budget=budget)
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=FREE,
                               agree_on=lambda x: calls.append(x) or x)
    rows = _rows(2)
    for _ in range(12):  # the guard's plain and drafting steps
        n = len(calls)
        policy.observe(rows, policy.draft(rows), [[0]] * 2, TIMES)
        assert len(calls) - n == (0 if budget == "fixed" else 1)


def test_a_step_whose_time_is_not_its_own_teaches_no_timing():
    """A step beside which other work ran (a prefill: ``times`` None) agrees on nothing and moves
    neither the speed guard nor the realised rates; its acceptance is still learned."""
    calls = []
    policy = SpeculationPolicy(SpecConfig(method="logitspec", budget="auto"), max_context=1000,
                               read_columns=float, cost_curve=FREE, agree_on=lambda x: calls.append(x) or x)
    rows = _rows(2)

    def learned():  # the speed guard's per-class samples and the realised rates
        return repr({c: vars(k) for c, k in policy.guard._classes.items()}), policy.realised.as_dict()

    plan = policy.draft(rows)
    before, tries = learned(), policy.acceptance.tries.sum()
    policy.observe(rows, plan, [[0]] * 2, None)
    assert calls == [] and learned() == before
    assert policy.acceptance.tries.sum() > tries
    policy.observe(rows, policy.draft(rows), [[0]] * 2, TIMES)  # the control: a step's own time is learned
    assert len(calls) == 1 and learned() != before


class ClockReading(float):
    """A step time that refuses to be read: any arithmetic, comparison or conversion raises; its value
    is ``seconds`` (what agreeing reads)."""

    def __new__(cls, seconds: float):
        out = super().__new__(cls, seconds)
        out.seconds = seconds
        return out

    def _refuse(self, *args):
        raise AssertionError("a step's timing was read without agreeing on it first (agree_on)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __float__ = __bool__ = __round__ = _refuse


def test_the_budget_reads_a_steps_timings_only_as_the_group_agreed_on_them():
    """The one place a decision reads a clock: every timing the auto budget acts on (the speed guard,
    drafting's share of a step, the curve's staleness, the realised rates) comes out of ``agree_on``;
    the raw timings handed to ``observe`` are never read (each raises here). Drafting and plain steps,
    the curve checked for staleness."""
    agreed = []

    def agree(times):
        agreed.append(times)
        return {k: v.seconds for k, v in times.items()}

    cfg = SpecConfig(method="logitspec", budget="auto")
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=FREE, agree_on=agree,
                               remeasure_curve=lambda: FREE)
    rows = _rows(2)
    sizes = []
    for step in range(40):
        plan = policy.draft(rows)
        trees = plan.trees
        sizes.append(max(len(t) for t in trees))
        paths = [[0, 1] if len(t) > 1 and step % 2 else [0] for t in trees]
        policy.observe(rows, plan, paths, {k: ClockReading(v) for k, v in TIMES.items()})
    assert len(agreed) == 40
    assert min(sizes) == 1 < max(sizes)  # plain steps (the guard's) and drafting steps both ran
    assert policy._plain_ratios or policy.remeasures  # the staleness check read its agreed time


def test_a_stale_curve_is_measured_again_and_what_was_learned_against_it_restarts(caplog):
    """A curve measured while the machine ran 15x slower (seen here) prices every node wrongly: once
    this run's plain steps take a far different time (median of STALE_STEPS), the policy measures the
    curve again, once per such finding and at most MAX_REMEASURES times."""
    slow = CostCurve([1, 64], [15.0, 15.0 * 630])  # 15x what the steps below take
    fresh = CostCurve([1, 64], [1.0, 630.0])
    made = []
    cfg = SpecConfig(method="logitspec", budget="auto")
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=slow,
                               remeasure_curve=lambda: made.append(1) or fresh)
    rows = _rows(1)
    plain = {"draft_s": 0.0, "forward_s": 1.0, "verify_s": 0.0, "commit_s": 0.0}
    for step in range(3 * policy_module.STALE_STEPS):
        plan = policy.draft(rows)
        policy.observe(rows, plan, [[0]], plain)
        if step == policy_module.STALE_STEPS - 2:
            assert not made  # not before STALE_STEPS plain steps
    assert made == [1] and policy.cost_curve is fresh  # the fresh curve agrees: not measured again
    assert "the forward cost curve is stale" in caplog.text
    # a machine that stays at another speed: measured again at most MAX_REMEASURES times
    made.clear()
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=slow,
                               remeasure_curve=lambda: made.append(1) or slow)
    for _ in range(5 * policy_module.STALE_STEPS):
        policy.observe(rows, policy.draft(rows), [[0]], plain)
    assert len(made) == policy_module.MAX_REMEASURES
    # without a way to measure (a tensor-parallel group's curve), nothing changes
    policy = SpeculationPolicy(cfg, max_context=1000, read_columns=float, cost_curve=slow)
    for _ in range(2 * policy_module.STALE_STEPS):
        policy.observe(rows, policy.draft(rows), [[0]], plain)
    assert policy.cost_curve is slow


@pytest.mark.parametrize("rows", [1, 3])
def test_logitspecs_first_chain_keeps_at_least_what_pld_keeps_under_the_auto_budget(rows):
    """With the same cost curve and acceptance rates, a logitspec tree (its chain and guess branches)
    keeps at least as many of its chain's nodes as pld's tree (the chain alone) keeps: the guesses
    take only nodes beyond the chain's. Over 40 random rate tables, some favouring the guesses."""
    rng = np.random.default_rng(0)
    curve = CostCurve([1, 2, 4, 8, 16, 33], [1.0, 1.15, 1.3, 1.6, 2.2, 3.5],
                      head={"tokens": [1, 64], "seconds": [0.01, 0.5]})
    guessed = 0
    for _ in range(40):
        ls, pld = _policy(curve), _policy(curve, method="pld")
        rates = rng.uniform(0.05, 0.95, ls.acceptance.hits.shape)
        for p in (ls, pld):
            p.acceptance.tries[:] = 10.0
            p.acceptance.hits[:] = 10.0 * rates
        batch = [Row([7, 1, 2, 3, 4, 5, 6, 8, 9] * 3 + [7, 1][: 1 + b % 2], guesses=[11, 12, 2, 13, 14])
                 for b in range(rows)]
        trees, plain_chains = ls.draft(batch).trees, [len(t) - 1 for t in pld.draft(batch).trees]
        chains = [int(np.isin(t.kinds, LOOKUP_KINDS).sum()) for t in trees]
        assert all(c >= p for c, p in zip(chains, plain_chains)), (chains, plain_chains)
        guessed += sum(len(t) - 1 > c for t, c in zip(trees, chains))
    assert guessed  # guess branches were kept too: the test is not of chains alone
