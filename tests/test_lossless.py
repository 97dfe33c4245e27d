"""Greedy speculative output == plain greedy output, for every method and model family."""
import pytest
from tiny_models import FAMILIES, hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig

N_NEW = 24


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request):
    model = tiny_model(request.param)
    prompts = repetitive_prompts(8, seed=1)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    return request.param, model, prompts, refs


@pytest.mark.parametrize("method", ["ar", "pld", "logitspec", "rest", "lookahead"])
def test_greedy_equals_hf_generate_batch1(family_case, method):
    family, model, prompts, refs = family_case
    res = Engine(model, None, SpecConfig(method=method, budget="fixed")).generate(
        prompts, max_new_tokens=N_NEW)
    for r, ref in zip(res, refs):
        assert r.token_ids == ref
        assert sum(r.stats["accepted_lengths"]) == N_NEW
        assert r.finish_reason == "length"
    if method == "ar":
        assert all(r.stats["mean_accepted"] == 1.0 for r in res)
    else:  # repetitive prompts: drafts must be accepted sometimes, or the test proves nothing
        assert max(r.stats["mean_accepted"] for r in res) > 1.2


@pytest.mark.parametrize("method", ["ar", "pld", "logitspec", "rest", "lookahead"])
def test_continuous_batching_equals_batch1(family_case, method):
    family, model, prompts, refs = family_case
    res = Engine(model, None, SpecConfig(method=method, max_batch_size=4, budget="fixed")).generate(
        prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs


def test_paper_budget_lossless(family_case):
    family, model, prompts, refs = family_case
    res = Engine(model, None, SpecConfig.paper(method="logitspec", max_batch_size=3)).generate(
        prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs
    small = Engine(model, None, SpecConfig(method="logitspec", capacity=4, budget="fixed")).generate(
        prompts, max_new_tokens=N_NEW)

    def mean_tree(rs):
        return sum(r.stats["mean_tree_size"] for r in rs) / len(rs)

    assert mean_tree(res) > mean_tree(small) + 4  # the big budget is really used


def test_long_prompt_admitted_mid_run_with_chunked_prefill():
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(5, seed=3)
    long_prompt = (prompts[0] * 20)[:70]
    prompts.insert(3, long_prompt)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    eng = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2, budget="fixed"),
                 prefill_chunk=16)
    assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=N_NEW)] == refs


def test_eos_stops_and_is_kept():
    model = tiny_model("llama")
    prompt = repetitive_prompts(1, seed=2)[0]
    ref = hf_greedy(model, prompt, 12)
    eos = ref[5]
    model.generation_config.eos_token_id = eos
    for method in ("ar", "logitspec"):
        r = Engine(model, None, SpecConfig(method=method)).generate([prompt], max_new_tokens=12)[0]
        assert r.token_ids == ref[: ref.index(eos) + 1]
        assert r.finish_reason == "stop"


@pytest.mark.parametrize("slope,expect_drafts", [(0.0, True), (10.0, False)])
def test_auto_budget_follows_the_cost_curve(family_case, slope, expect_drafts):
    """Free extra tokens: verify drafts; very costly ones: plain decoding. Lossless either way."""
    from logitspec.spec_decode.budget import CostCurve

    family, model, prompts, refs = family_case
    curve = CostCurve([1, 64], [1.0, 1.0 + 63 * slope])
    res = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2), cost_curve=curve).generate(
        prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs
    mean_tree = sum(r.stats["mean_tree_size"] for r in res) / len(res)
    # costly drafts: only the occasional 2-node exploration step remains
    assert (mean_tree > 1.0) == expect_drafts, mean_tree


@pytest.mark.parametrize("share,skips", [(0.0, True), (2.0, False)])
def test_plain_choice_skips_drafting_between_rechecks(family_case, monkeypatch, share, skips):
    """While the budget chooses plain decoding and drafting is a noticeable share of a step's time
    (here: any share, or none ever), drafts are built only on every RECHECK_EVERY-th step; lossless."""
    from logitspec.spec_decode import policy as policy_module
    from logitspec.spec_decode.budget import CostCurve

    monkeypatch.setattr(policy_module, "SKIP_DRAFT_SHARE", share)
    family, model, prompts, refs = family_case
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2),
                    cost_curve=CostCurve([1, 64], [1.0, 631.0]))
    calls, draft = [], engine.policy.drafter.draft
    engine.policy.drafter.draft = lambda *a: calls.append(1) or draft(*a)
    engine.policy.guard.mode = lambda rows: "draft"  # the budget's own schedule (the guard's: test_evidence)
    res = engine.generate(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs
    row_steps = sum(r.stats["steps"] - 1 for r in res)  # decoding steps (the prefill emits the first token)
    if skips:
        assert 0 < len(calls) <= row_steps / policy_module.RECHECK_EVERY + 2 * len(res), \
            (len(calls), row_steps)
    else:
        # every step drafts (less final steps)
        assert len(calls) >= row_steps - len(res), (len(calls), row_steps)


def test_per_row_budget_at_batch_is_lossless(family_case):
    """A decoder whose padded width is nearly free and an output layer that costs per node: rows
    get their own node counts (some none), and the output stays plain greedy."""
    from logitspec.spec_decode.budget import CostCurve

    family, model, prompts, refs = family_case
    rows = {4: {"tokens": [1, 2, 4, 8], "seconds": [1.0, 1.05, 1.1, 1.2]}}
    curve = CostCurve([1, 64], [1.0, 2.0], batches=rows, head={"tokens": [1, 64], "seconds": [0.05, 3.2]})
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=4), cost_curve=curve)
    res = engine.generate(prompts, max_new_tokens=N_NEW)
    assert [r.token_ids for r in res] == refs
    sizes = [n for r in res for n in r.stats["accepted_lengths"]]
    assert max(sizes) > 1  # drafts were verified and accepted


@pytest.mark.parametrize("family", FAMILIES)
def test_skinny_kernels_and_screened_head_equal_stock_generate(family):
    """The CPU fast paths (skinny linears in the decoder, screened greedy head) against stock
    transformers: references are computed before the swap, with plain nn.Linear modules."""
    from logitspec.kernels.skinny import available, use_skinny_linears

    if not available():
        pytest.skip("skinny kernel does not build here")
    model = tiny_model(family)
    prompts = repetitive_prompts(6, seed=5)
    refs = [hf_greedy(model, p, N_NEW) for p in prompts]
    assert use_skinny_linears(model) > 0
    for method in ("ar", "logitspec"):
        eng = Engine(model, None, SpecConfig(method=method, max_batch_size=3, budget="fixed"))
        assert eng.runner.head.screen is not None
        assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=N_NEW)] == refs
