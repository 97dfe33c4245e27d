"""The int8 pass of the greedy screen: its per-token bound holds (outlier channels, poor smoothing),
the argmax among its candidates is the float32 argmax, the race keeps the faster path, and the engine
stays lossless with the pass forced on. Where the CPU lacks AVX-512 VNNI the kernel's plain loop runs
the same integer sums, so these tests run on every machine the kernels build on."""
import pytest
import torch
from tiny_models import FAMILIES, hf_greedy, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.sample.int8_screen import Int8Pass, Int8Race, available
from logitspec.worker import head

pytestmark = pytest.mark.skipif(not available(), reason="the compiled kernels are not built here")


def _weight_and_states(seed: int, V: int = 1024, H: int = 64, n: int = 16):
    """A weight with a few large columns and hidden states with a few huge channels (as Gemma 3's
    final states have), so an unsmoothed 8-bit rounding would lose the small channels."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g) * 0.05
    weight[:, 5] *= 8
    x = torch.randn(n, H, generator=g) * 2
    x[:, 3] *= 50
    x[:, 17] *= 30
    return weight, x


@pytest.mark.parametrize("rows", [1, 5, 8, 16])
def test_the_bound_holds_per_token_and_the_floor_is_the_largest_lower_bound(rows):
    weight, x = _weight_and_states(rows)
    for sample in (x, torch.randn(4, x.shape[1])):  # smoothed by these states, or by unrelated ones
        p = Int8Pass(weight, sample, head.ROUNDING_SLACK)
        scores, coef, floor = p(x[:rows])
        exact = x[:rows].double() @ weight.double().T  # [N, V]
        bound = coef.double() @ p.norms.double()  # [N, V]
        assert ((scores.double() - exact).abs() <= bound).all()
        assert torch.allclose(floor.double(), (scores.double() - bound).amax(dim=1), rtol=1e-5, atol=1e-5)
        assert (floor.double() <= exact.amax(dim=1)).all()
        rows_, toks = p.candidates(scores, coef, floor)
        best = exact.argmax(dim=1)
        picked = {(int(r), int(t)) for r, t in zip(rows_, toks)}
        assert all((r, int(best[r])) in picked for r in range(rows))  # the argmax is always a candidate
        assert len(picked) < rows * weight.shape[0] // 4  # and the bound rules most tokens out


def test_the_argmax_among_candidates_is_the_float32_argmax_ties_to_the_lowest_token():
    weight, x = _weight_and_states(7, n=12)
    win = torch.mm(weight, x.T).argmax(dim=0)  # [N]
    weight[1000] = weight[int(win[0])]  # an exact tie: the lower token wins
    weight[int(win[1]) + 1] = weight[int(win[1])] + 1e-6  # a near tie, far below int8's resolution
    p = Int8Pass(weight, x, head.ROUNDING_SLACK)
    scores, coef, floor = p(x)
    rows, toks = p.candidates(scores, coef, floor)
    got = head.best_candidate(weight, x, rows, toks)
    assert torch.equal(got, torch.nn.functional.linear(x, weight).argmax(dim=1))


def test_a_screen_with_the_int8_pass_on_returns_the_float32_argmax(monkeypatch):
    monkeypatch.setattr(head, "INT8", "on")
    weight, x = _weight_and_states(3, V=2048, n=20)
    screen = head.ScreenedArgmax(weight)
    for rows in (slice(0, 1), slice(0, 6), slice(0, 16), slice(0, 20)):  # 20 rows: more than the pass takes
        out = screen(x[rows])
        assert torch.equal(out.argmax, torch.nn.functional.linear(x[rows], weight).argmax(dim=1))
    assert screen.int8.pass_ is not None
    nan = x[:2].clone()
    nan[1, 0] = float("nan")
    assert not screen.int8.offered(nan)  # a non-finite row takes the other passes (and their fallback)


def test_the_race_calibrates_first_then_keeps_the_faster_path_per_row_count():
    weight, x = _weight_and_states(4)
    race = Int8Race(weight, "on", head.ROUNDING_SLACK)
    race.mode = "auto"  # the decision logic of "auto", whatever this CPU has
    assert [race.choose(x[:5]) for _ in range(3)] == [False] * 3  # 15 rows seen: still calibrating
    assert race.pass_ is None
    use = race.choose(x[:1])  # the 16th row: built; trials alternate from here
    assert race.pass_ is not None
    for _ in range(2 * Int8Race.TRIALS):
        race.record(1, use, 0.001 if use else 0.002)
        use = race.choose(x[:1])
    assert race.chosen == {1: True} and race.choose(x[:1])
    for _ in range(2 * Int8Race.TRIALS):
        use = race.choose(x[:3])
        race.record(3, use, 0.003 if use else 0.002)
    assert race.chosen[3] is False and not race.choose(x[:3])


def test_a_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="int8 screen mode"):
        Int8Race(torch.zeros(16, 4), "sometimes", 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["ar", "logitspec"])
def test_the_engine_with_the_int8_pass_forced_on_equals_hf_generate(monkeypatch, family, method):
    monkeypatch.setattr(head, "INT8", "on")
    model = tiny_model(family)
    prompts = repetitive_prompts(6, seed=2)
    refs = [hf_greedy(model, p, 16) for p in prompts]
    engine = Engine(model, None, SpecConfig(method=method, max_batch_size=3, budget="fixed"))
    screen = engine.runner.head.screen
    if screen is None:
        pytest.skip(f"{family}: no screen (soft-capped logits)")
    assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=16)] == refs
    assert screen.int8.pass_ is not None  # the int8 pass served the greedy calls


def test_a_cost_measurement_never_takes_builds_or_times_the_int8_pass():
    """While a curve is measured the race is held: no build or trial falls inside a timed forward,
    and the measurement's chains (an arbitrary first token, a flat distribution) never take the pass
    (an 8-row step measured 69 ms with it, 34 without, and the budget drafted at a loss)."""
    from logitspec.worker import calibrate
    from logitspec.worker.eager_runner import EagerRunner

    target = EagerRunner(tiny_model("llama"))
    race = target.head.screen.int8
    race.mode, race.enabled = "auto", True  # the "auto" logic, whatever this CPU has
    calibrate.measure(target, tokens=(1, 4), context=12, reps=1, warmup=0, batch_rows=(2, 3),
                      batch_tokens=(1, 2))
    assert race.pass_ is None and race.sample == [] and race.chosen == {} and not race.held
    assert race.offered(torch.randn(2, target.model.config.hidden_size))  # and decoding gets it back


def test_too_many_candidates_hand_the_call_to_the_other_passes(monkeypatch):
    """A flat distribution leaves the int8 bound thousands of candidates, each a weight row to read:
    past ``MAX_CANDIDATES_PER_ROW`` a row the other passes serve the call (their bound is tighter)."""
    monkeypatch.setattr(head, "INT8", "on")
    weight, x = _weight_and_states(9, V=2048, n=6)
    screen = head.ScreenedArgmax(weight)
    assert screen(x).screen is None  # the int8 pass served it
    monkeypatch.setattr(head, "MAX_CANDIDATES_PER_ROW", 0)
    out = screen(x)
    assert out.screen is screen
    assert torch.equal(out.argmax, torch.nn.functional.linear(x, weight).argmax(dim=1))
