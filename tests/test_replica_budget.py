"""The replica's line on what the draft budget did (pipeline/replica/budget.py) and the per-row
``verified_steps`` it counts (logitspec/engine/stats.py, the output rows' column)."""
from __future__ import annotations

from logitspec.engine.stats import SequenceStats
from pipeline.replica.budget import LOG_EVERY_S, ReplicaBudget
from pipeline.rows import OutputRow


class Curve:
    """A 2-token forward costs 1.7x a 1-token one at any batch: a draft token pays above 70%."""

    def step(self, rows, per_row, columns=None):
        return rows * (1.0 if per_row == 1 else 1.7)


class Policy:
    cost_curve = Curve()


class Engine:
    policy = Policy()


def test_verified_steps_count_decode_steps_whose_tree_held_a_draft():
    s = SequenceStats()
    for emitted, size in [(1, 0), (1, 0), (3, 4), (1, 2), (1, 0)]:  # the prefill first
        s.add_step(emitted, retrieved=size > 0, tree_size=size)
    d = s.as_dict()
    assert d["verified_steps"] == 2 and d["steps"] == 5
    assert "verified_steps" in OutputRow.schema().names


def test_replica_budget_says_what_was_verified_and_what_pays():
    b = ReplicaBudget("logitspec", "cpu")
    rows = [OutputRow(id=i, accepted_lengths=[1] + [1] * 7 + [2] * (i + 1), verified_steps=2 + i,
                      retrieval_success=0.5, n_new_tokens=10) for i in range(2)]
    rows.append(OutputRow(id=9, error="too long"))
    b.add(rows, {"mean_active": 8.0, "batch_steps": 10}, Engine())
    st = b.stats()
    assert st["decode_steps"] == 8 + 9 and st["verified_steps"] == 5 and st["accepted_steps"] == 3
    assert st["batch"] == 8.0 and abs(st["break_even"] - 0.7) < 1e-9
    line = b.sentence()
    assert "drafts verified on 29.4% of steps, accepted on 17.6% (MAT 1.16)" in line
    assert "at batch 8 on this CPU a draft token must be accepted 70% of the time to pay" in line
    assert b.due(0.0) and not b.due(1.0) and b.due(LOG_EVERY_S + 1)


def test_plain_decoding_is_said_plainly():
    b = ReplicaBudget("logitspec", "cpu")
    b.add([OutputRow(id=0, accepted_lengths=[1] * 9, verified_steps=0)],
          {"mean_active": 8.0, "batch_steps": 8})
    assert b.sentence().startswith("decoded plainly: drafts verified on 0 of 8 steps")


def test_the_line_carries_the_auto_budgets_evidence():
    """A real policy's evidence after steps whose first nodes were never accepted: the line names the
    kind, its tests, acceptance interval and the break-even, the probes and the speed guard's modes."""
    from logitspec.spec_decode.budget import CostCurve
    from tests.test_evidence import BE20, TIMES
    from tests.test_policy import _policy, _rows

    policy = _policy(BE20, guard=True)
    rows = _rows(1)
    for _ in range(60):
        plan = policy.draft(rows)
        policy.observe(rows, plan, [[0]], TIMES)
    engine = type("E", (), {"policy": policy})()
    b = ReplicaBudget("logitspec", "cpu")
    b.add([OutputRow(id=0, accepted_lengths=[1] * 61, verified_steps=10)], {"mean_active": 1.0,
                                                                           "batch_steps": 60}, engine)
    line = b.sentence()
    assert isinstance(policy.cost_curve, CostCurve)
    assert "; evidence: lookup first nodes accepted 0% of " in line
    assert "against a break-even of 20% at 1 row(s)" in line
    assert "rows probed" in line and "from 1 rows: drafting steps" in line and "verdict" in line
