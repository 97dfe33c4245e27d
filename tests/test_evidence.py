"""The auto budget's evidence: first-node acceptance intervals (probes until sound, re-checks as
evidence ages) and the speed guard (plain steps against drafting ones, by the clock)."""
import math

import numpy as np
import pytest

from logitspec.spec_decode import evidence as ev
from logitspec.spec_decode.budget import CostCurve, break_even
from logitspec.spec_decode.evidence import FirstNodeEvidence, SpeedGuard, wilson
from tests.test_policy import Row, _policy, _rows

# one drafted node per row costs 0.2 of a plain step at 1 row: a first node must be accepted 20%
BE20 = CostCurve([1, 2, 64], [1.0, 1.2, 13.6])
TIMES = {"draft_s": 0.0, "forward_s": 1.0, "verify_s": 0.0, "commit_s": 0.0}


def test_wilson_interval_matches_its_closed_form():
    # no hits in n tries: the upper end is z^2 / (n + z^2)
    for n in (1, 10, 100):
        lo, hi = wilson(0, n)
        assert lo == 0 and hi == pytest.approx(ev.Z ** 2 / (n + ev.Z ** 2))
    lo, hi = wilson(50, 100)  # symmetric around 0.5, narrower with more tries
    assert lo + hi == pytest.approx(1.0) and hi - lo < wilson(5, 10)[1] - wilson(5, 10)[0]
    assert wilson(0, 0) == (0.0, 1.0)


def test_break_even_of_the_curve():
    assert break_even(BE20, 1) == pytest.approx(0.2)
    assert math.isnan(break_even(CostCurve([1, 2], [0.0, 0.0]), 1))


def test_rows_the_point_estimate_drops_are_probed_until_the_evidence_is_sound():
    """First nodes never accepted, break-even 20%: the budget's point estimate soon verifies
    nothing, but rows keep verifying their first node while the acceptance interval's upper end
    reaches 20%; then the probes stop; as the counts decay the kind is probed again."""
    policy = _policy(BE20)
    rows = _rows(1)
    verified = []
    for _ in range(400):
        plan = policy.draft(rows)
        trees = plan.trees
        verified.append(len(trees[0]) - 1)
        policy.observe(rows, plan, [[0]], TIMES)
    tried = policy.evidence.tries.sum()
    # sound after enough tries: the upper end z^2 / (n + z^2) < 0.2 needs n > 10.8
    n_sound = ev.Z ** 2 * (1 - 0.2) / 0.2
    assert tried >= n_sound * 0.9  # the decayed counts hover near the point where evidence is sound
    late = verified[100:]
    assert set(late) == {0, 1}  # the point estimate verifies nothing; probes verify one node
    assert policy.probes >= late.count(1) > 0  # re-checked as evidence ages ...
    assert late.count(1) < len(late) / 8  # ... rarely


def test_rows_with_good_first_nodes_are_not_probed_once_drafting_is_chosen():
    policy = _policy(CostCurve([1, 64], [1.0, 1.0]))  # free nodes: the budget verifies whole trees
    rows = _rows(1)
    for _ in range(5):
        plan = policy.draft(rows)
        trees = plan.trees
        assert len(trees[0]) > 2
        policy.observe(rows, plan, [[0, 1]], TIMES)
    assert policy.probes == 0


def test_first_node_evidence_counts_each_tested_child_of_the_root():
    policy = _policy(CostCurve([1, 64], [1.0, 1.0]))
    rows = [Row([1, 2, 3, 4, 5] * 4 + [1, 2], guesses=[9, 8])]
    tree = policy.draft(rows).trees[0]
    children = np.flatnonzero(tree.parents[1:] == 0) + 1
    assert len(children) >= 2  # the lookup chain and a guess branch
    e = FirstNodeEvidence(1, int(tree.kinds.max()) + 1)
    e.update(tree, [0, int(children[0])], 0)
    assert e.tries.sum() == len(children) and e.hits.sum() == 1
    assert e.hits[0, tree.kinds[children[0]]] == 1


def _drive_guard(guard: SpeedGuard, draft_rate: float, plain_rate: float, steps: int, rows: int = 4,
                 seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    modes = []
    for _ in range(steps):
        m = guard.mode(rows)
        rate = draft_rate if m == "draft" else plain_rate
        guard.record(rows, m, rows, rows / (rate * rng.uniform(0.8, 1.25)))  # noisy seconds
        modes.append(m)
    return modes


def test_the_guard_turns_drafting_off_when_plain_steps_are_faster():
    guard = SpeedGuard()
    modes = _drive_guard(guard, draft_rate=8.0, plain_rate=10.0, steps=300)
    assert modes[:12].count("draft") == 6  # interleaved while learning
    # then plain, drafting re-checked every RECHECK_DRAFT-th step (never locked out)
    assert 0 < modes[-100:].count("draft") <= 100 // ev.RECHECK_DRAFT + 2
    assert guard.summary()["4"]["verdict"] == "plain"


def test_the_guard_keeps_drafting_when_drafting_is_faster():
    guard = SpeedGuard()
    modes = _drive_guard(guard, draft_rate=12.0, plain_rate=10.0, steps=300)
    assert modes[-100:].count("draft") >= 90 and modes[-100:].count("plain") > 0
    assert guard.summary()["4"]["verdict"] == "draft"


def test_the_guard_changes_its_verdict_when_speeds_change():
    guard = SpeedGuard()
    _drive_guard(guard, draft_rate=8.0, plain_rate=10.0, steps=200)
    modes = _drive_guard(guard, draft_rate=20.0, plain_rate=10.0, steps=400, seed=1)
    assert modes[-100:].count("draft") >= 90


@pytest.mark.parametrize("seed", range(10))
def test_the_guard_resumes_drafting_within_a_few_steps_once_it_pays(seed):
    """One row: 80 steps of answers where a drafting step commits 0.85x a plain step's tokens per
    second, then answers where drafting pays 3x (1 to 6 tokens a step, as a row's vary). Plain
    decoding has won meanwhile; it still gives way within the next 150 steps after at most 12 plain
    steps. (A guard that re-checked drafting at doubling intervals of up to 64 steps took 58 and 121
    with seeds 1 and 6: a whole answer or two decoded plainly at a third of the speed.)"""
    rng = np.random.default_rng(seed)
    guard, modes = SpeedGuard(), []
    for steps, drafted in ((80, 0.85), (150, 3.0)):
        for _ in range(steps):
            m = guard.mode(1)
            tokens = max(1, round(rng.normal(drafted, drafted / 2))) if m == "draft" else 1
            guard.record(1, m, tokens, 0.05 * rng.uniform(0.9, 1.3 if m == "draft" else 1.1), plain_s=0.05)
            modes.append(m)
    assert "plain" in modes[40:80]  # plain decoding did win the first answers
    assert modes[80:].count("plain") <= 12


def test_the_policy_decodes_plainly_when_drafting_steps_are_slower():
    """Free nodes by the curve (the budget drafts whole trees) but every drafting step takes 3x a
    plain step's time and accepts nothing: the guard switches the policy to plain steps."""
    policy = _policy(CostCurve([1, 64], [1.0, 1.0]), guard=True)
    rows = _rows(2)
    nodes = []
    for _ in range(200):
        plan = policy.draft(rows)
        trees = plan.trees
        drafted = sum(len(t) - 1 for t in trees)
        nodes.append(drafted)
        t = dict(TIMES, forward_s=3.0 if drafted else 1.0)
        policy.observe(rows, plan, [[0]] * len(rows), t)
    assert sum(1 for n in nodes[-100:] if n) <= 100 // ev.RECHECK_DRAFT + 2  # re-checks only
    summary = policy.evidence_summary(2)
    # plain won; once the budget itself chooses no nodes, steps that may draft are plain steps too
    assert summary["speed"]["2"]["verdict"] in ("plain", "undecided")
    # the curve prices nodes at nothing; the learned cost correction prices drafting steps above
    assert summary["break_even"] > 0.3


def test_the_guard_compares_steps_of_different_row_counts_per_row():
    """Drafting steps of 4 rows (1.5 tokens a row in 1.2 plain steps' time) against plain steps of 7
    rows (in the same class): per row drafting is faster, though the 7-row steps commit more tokens
    a second; the guard, given each step's plain time, keeps drafting."""
    guard = SpeedGuard()
    for _ in range(40):
        m = guard.mode(4)
        if m == "draft":
            guard.record(4, "draft", 6, 1.2, plain_s=1.0)
        else:
            guard.record(7, "plain", 7, 1.0, plain_s=1.0)
    assert guard.summary()["4"]["verdict"] == "draft"
    assert guard.summary()["4"]["plain"]["tokens_per_s"] > guard.summary()["4"]["draft"]["tokens_per_s"]


def test_a_draining_batch_probes_only_rows_whose_tokens_save_time():
    """In a batch that only drains, a row ahead of the others saves nothing of the batch's time with
    its tokens (a step costs the same with fewer rows here), so it is never probed; the row that
    alone sets the batch's end is. Not draining, every row is."""
    flat_rows = CostCurve([1, 2, 64], [1.0, 1.2, 13.6],
                          batches={4: {"tokens": [1, 2], "seconds": [1.0, 1.2]}})
    for draining in (True, False):
        policy = _policy(flat_rows)
        rows = _rows(4)
        for r, left in zip(rows, (40, 10, 10, 10)):
            r.remaining = left
        probed = np.zeros(4, dtype=int)
        for _ in range(30):
            plan = policy.draft(rows, draining=draining)
            trees = plan.trees
            probed += [len(t) > 1 for t in trees]
            policy.observe(rows, plan, [[0]] * 4, TIMES)
        assert probed[0] > 0
        assert (probed[1:] == 0).all() if draining else (probed[1:] > 0).all()
