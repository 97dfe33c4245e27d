"""The budget's estimates corrected by what steps deliver (logitspec/spec_decode/feedback.py) and their
use."""
import numpy as np
import pytest
from tiny_models import hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.spec_decode.budget import CostCurve, choose_sizes, estimate
from logitspec.spec_decode.feedback import LIMIT, Realised


def test_corrections_start_neutral_and_learn_tokens_and_cost():
    fix = Realised(prior=2.0, decay=0.9).of(6)
    assert fix.tokens == 1.0 and fix.cost == 1.0
    for _ in range(60):
        fix.update(0.0, 0, curve_s=0.10, measured_s=0.07)  # plain steps: 0.7 of the curve
        fix.update(4.0, 2, curve_s=0.20, measured_s=0.28)  # drafting steps: half the tokens, 1.4 of the curve
    assert fix.tokens == pytest.approx(0.5, rel=0.02)
    assert fix.cost == pytest.approx(2.0, rel=0.05)  # 1.4 against plain steps' 0.7


def test_without_drafting_steps_the_cost_stays_neutral():
    """Plain steps far from the curve say nothing about drafting: the cost correction stays 1."""
    fix = Realised().of(24)
    for _ in range(100):
        fix.update(0.0, 0, curve_s=0.10, measured_s=0.05)
    assert fix.cost == 1.0 and fix.tokens == 1.0


def test_corrections_are_bounded_and_kept_per_batch_class():
    r = Realised(prior=1.0, decay=0.5)
    for _ in range(50):
        r.of(24).update(10.0, 0, curve_s=0.01, measured_s=5.0)  # nothing accepted, far dearer than the curve
    assert r.of(24).tokens == 1 / LIMIT and r.of(24).cost == LIMIT
    assert r.of(16) is r.of(31) and r.of(8) is not r.of(16)
    assert r.of(4).tokens == 1.0 and r.of(4).cost == 1.0  # other classes untouched
    assert r.as_dict()["budget_cost_scale@16"] == LIMIT


def test_one_row_gets_no_corrections():
    r = Realised(prior=1.0, decay=0.5)
    for _ in range(20):
        r.of(1).update(10.0, 0, curve_s=0.01, measured_s=5.0)
    assert r.of(1).tokens == 1.0 and r.of(1).cost == 1.0 and r.as_dict() == {}


def test_bad_timings_are_ignored():
    fix = Realised().of(2)
    fix.update(3.0, 3, curve_s=0.0, measured_s=0.1)
    fix.update(3.0, 0, curve_s=0.1, measured_s=0.0)
    assert fix.tokens == 1.0 and fix.cost == 1.0


def _batch_curve():
    head = {"tokens": [1, 64], "seconds": [0.002, 0.128]}
    batches = {8: {"tokens": [1, 2, 3], "seconds": [0.05, 0.07, 0.09]}}
    return CostCurve([1, 64], [0.03, 0.3], batches=batches, head=head)


def test_choose_sizes_follows_the_corrections():
    """Drafts that pay by the estimates are dropped once the tokens are seen to be half as many or
    drafting steps twice as dear; drafts that just miss are taken once drafting is seen to be cheaper."""
    c = _batch_curve()
    good = [np.array([0.8, 0.7])] * 8
    assert any(choose_sizes(good, c, 2))
    assert not any(choose_sizes(good, c, 2, token_scale=0.25))
    assert not any(choose_sizes(good, c, 2, cost_scale=2.0))
    poor = [np.array([0.3, 0.1])] * 8
    assert not any(choose_sizes(poor, c, 2))
    assert any(choose_sizes(poor, c, 2, cost_scale=0.6))


def test_estimate_is_the_budgets_own_model():
    c = _batch_curve()
    probs = [np.array([0.9, 0.5]), np.array([0.4, 0.1])] * 4
    sizes = [2, 1] * 4
    tokens, secs = estimate(probs, sizes, c)
    assert tokens == pytest.approx(4 * (1.4 + 0.4))
    assert secs == pytest.approx(c.step(8, 3) - c.head_time(24) + c.head_time(8 + 12))
    assert estimate(probs, [0] * 8, c) == (0.0, c.step(8, 1))


def test_engine_learns_corrections_and_stays_lossless():
    """Steps of the auto budget feed the corrections of their batch class (reported in the run's
    stats); the output is plain greedy's."""
    model = tiny_model("llama")
    prompts = repetitive_prompts(4, seed=3)
    refs = [hf_greedy(model, p, 20) for p in prompts]
    curve = CostCurve([1, 64], [1.0, 1.0])  # free drafts: the budget verifies
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2), cost_curve=curve)
    run = engine.run(prompts, max_new_tokens=20)
    assert [r.token_ids for r in run.results] == refs
    fix = engine.policy.realised.of(2)
    assert fix.tokens != 1.0 and fix.cost != 1.0  # drafting and plain steps were both seen
    assert 1 / LIMIT <= fix.tokens <= LIMIT and 1 / LIMIT <= fix.cost <= LIMIT
    assert run.stats["budget_token_scale@2"] == fix.tokens
    plain = Engine(model, None, SpecConfig(method="ar", max_batch_size=2))
    assert "budget_token_scale@2" not in plain.run(prompts, max_new_tokens=4).stats
