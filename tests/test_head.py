"""The screened greedy output layer: its argmax is the float32 argmax, near-ties included."""

import pytest
import torch
from torch import nn

from logitspec.kernels import skinny
from logitspec.worker.head import ScreenedArgmax as _Screen

pytestmark = pytest.mark.skipif(not _Screen.supported(torch.zeros(1, 1)), reason="no float16 kernels")


def _kinds():
    from logitspec.kernels import onednn
    from logitspec.worker.head import has_fbgemm

    kinds = ["f16c"] if skinny.available() else []
    kinds += ["fbgemm"] if has_fbgemm() else []
    kinds += ["onednn"] if onednn.available() else []
    kinds += ["bf16"] if onednn.available() and onednn.bf16_supported() else []
    return kinds + (["auto"] if len(kinds) >= 2 else [])


@pytest.fixture(params=_kinds())
def ScreenedArgmax(request):
    """The screen with each pass this machine has (the F16C kernel, fbgemm, oneDNN float32 and
    bfloat16, the timed choice)."""
    make = lambda weight: _Screen(weight, kind=request.param)  # noqa: E731
    make.kind = request.param
    return make


def _reference(weight, x):
    return torch.nn.functional.linear(x, weight).argmax(dim=1)


def test_argmax_equals_float32_argmax_on_random_states(ScreenedArgmax):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=g) * 0.05
    x = torch.randn(200, 64, generator=g) * 20
    screen = ScreenedArgmax(weight)
    for rows in (slice(0, 1), slice(0, 7), slice(0, 200)):
        assert torch.equal(screen(x[rows]).argmax, _reference(weight, x[rows]))


def test_near_ties_below_half_precision_resolved_in_float32(ScreenedArgmax):
    """Pairs of rows whose logits differ by less than float16 resolves (but far more than float32
    rounding): the half-precision pass ranks some of them wrongly; the screen must still return
    the float32 winner."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(3000, 32, generator=g)
    x = torch.randn(40, 32, generator=g)
    for i in range(40):
        win = int((weight @ x[i]).argmax())
        weight[(win + 1 + i) % weight.shape[0]] = weight[win] + 2e-4 * torch.randn(32, generator=g)
    out = ScreenedArgmax(weight)(x)
    ref = _reference(weight, x)
    if ScreenedArgmax.kind in ("f16c", "fbgemm", "bf16"):
        assert (out.scores.argmax(dim=1) != ref).sum() >= 3  # the half-precision pass alone would be wrong
    assert torch.equal(out.argmax, ref)


def test_exact_ties_go_to_the_lowest_token_id(ScreenedArgmax):
    weight = torch.randn(100, 16)
    weight[70] = weight[10] = torch.ones(16) * 5
    x = torch.ones(3, 16)
    assert ScreenedArgmax(weight)(x).argmax.tolist() == [10, 10, 10]


def test_scores_approximate_the_logits_within_the_bound(ScreenedArgmax):
    weight = torch.randn(1000, 48)
    x = torch.randn(5, 48)
    x[0, 7] = 90.0  # an outlier channel, as in Gemma's final hidden states
    screen = ScreenedArgmax(weight)
    out = screen(x)
    assert not out.exact
    err = (out.scores.double() - (x.double() @ weight.double().T)).abs().max(dim=1).values  # [5]
    assert (err <= screen.bound_per_norm * x.norm(dim=1).double()).all()
    assert (err < 0.05 * x.norm(dim=1) * weight.norm(dim=1).max()).all()  # and the bound is a close one


def test_the_bound_covers_the_passes_output_rounding(ScreenedArgmax):
    """Weights and inputs that bfloat16 and float16 hold exactly: what is left of a pass's error is
    its own rounding (the bfloat16 pass returns bfloat16 logits, rounded to 8 significant bits);
    the bound must cover it too (the bound before this test was 1.25x short on one of these rows)."""
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(4000, 32, generator=g).bfloat16().float()  # exact in bfloat16 and float16
    # each along a longest weight row: |logit| = ||W_v|| ||x||
    x = weight[weight.norm(dim=1).topk(6).indices] * 4
    screen = ScreenedArgmax(weight)
    err = (screen(x).scores.double() - (x.double() @ weight.double().T)).abs().max(dim=1).values  # [6]
    assert (err <= screen.bound_per_norm * x.norm(dim=1).double()).all()


def test_non_finite_rows_fall_back_to_float32(ScreenedArgmax):
    weight = torch.randn(100, 16)
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    got = ScreenedArgmax(weight)(x).argmax
    assert got[0] == _reference(weight, x[:1])[0]
    assert 0 <= int(got[1]) < 100


def test_more_rows_than_the_kernel_takes_at_once(ScreenedArgmax):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(700, 40, generator=g)
    x = torch.randn(150, 40, generator=g)  # > skinny.MAX_ROWS: the F16C pass goes in chunks
    out = ScreenedArgmax(weight)(x)
    assert out.scores.shape == (150, 700)
    assert torch.equal(out.argmax, _reference(weight, x))


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="kind"):
        _Screen(torch.randn(4, 8), kind="int8")


def test_a_pass_this_machine_lacks_is_rejected(monkeypatch):
    monkeypatch.setattr(skinny, "available", lambda: False)
    with pytest.raises(ValueError, match="not available"):
        _Screen(torch.randn(4, 8), kind="f16c")


def test_auto_times_its_passes_then_keeps_the_fastest_per_row_count():
    kinds = [k for k in _kinds() if k != "auto"]
    if len(kinds) < 2:
        pytest.skip("one pass only on this machine")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4000, 64, generator=g)
    screen = _Screen(weight, kind="auto")
    calls = _Screen.TRIALS * len(screen.passes)
    for rows in (1, 30):
        x = torch.randn(rows, 64, generator=g)
        settled = []
        for _ in range(calls + 2):
            assert torch.equal(screen(x).argmax, _reference(weight, x))  # exact whichever pass ran
            settled.append(screen._bucket(rows) in screen.choices())
        # settled after TRIALS calls of each pass at the latest (sooner when one pass is decisively
        # slower, or, for 30 rows, at once if 1 row's trials were decisive), and for good
        assert settled[calls - 1] and settled == sorted(settled)
    assert set(screen.choices().values()) <= set(screen.passes)


def test_a_decisively_slower_pass_is_dropped_after_one_trial_and_not_tried_at_larger_row_counts():
    """The passes' costs are scripted on a virtual clock: the choice depends on them, not on the load."""
    weight = torch.randn(500, 16)
    now = [0.0]
    screen = _Screen(weight, kind="auto", clock=lambda: now[0])
    calls = []

    def timed(name, seconds):
        def run(x):
            calls.append((name, len(x)))
            now[0] += seconds
            return x @ weight.T
        return run

    screen.passes = {"fast": timed("fast", 0.001), "slow": timed("slow", 0.03)}
    for rows in (2, 20, 40, 100):
        for _ in range(3):
            screen.approx_logits(torch.randn(rows, 16))
    assert [c for c in calls if c[0] == "slow"] == [("slow", 2)]  # one trial, at the smallest size
    assert set(screen.choices().values()) == {"fast"}
    assert sorted(screen.choices()) == [2, 32, 64, 128]
    # close timings take the full TRIALS each
    even = _Screen(weight, kind="auto", clock=lambda: now[0])
    calls.clear()
    even.passes = {"a": timed("a", 0.02), "b": timed("b", 0.022)}
    for _ in range(2 * _Screen.TRIALS):
        even.approx_logits(torch.randn(3, 16))
    assert sorted(calls) == [("a", 3)] * _Screen.TRIALS + [("b", 3)] * _Screen.TRIALS
    assert 3 in even.choices()


def test_engines_over_one_model_share_one_screen():
    from logitspec.worker.head import shared_screen

    weight = nn.Parameter(torch.randn(300, 16), requires_grad=False)
    assert shared_screen(weight) is shared_screen(weight)
    assert shared_screen(nn.Parameter(weight.detach().clone(),
                                      requires_grad=False)) is not shared_screen(weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screen_candidates_kernel_equals_the_torch_search(dtype):
    """The compiled candidate search gives exactly torch's nonzero(approx >= amax - margin), and no
    candidates for a row holding a NaN (its argmax then comes from the full product); on bfloat16
    scores (the bfloat16 pass's, not widened) the same as on their float32 copy."""
    from logitspec.kernels import skinny
    from logitspec.worker.head import _candidates
    if skinny.extension() is None:
        pytest.skip("the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(5)
    # V not a multiple of 8: the tail is searched too
    approx = (torch.randn(7, 1003, generator=g) * 3).to(dtype)
    approx[2, 1001] = approx[2].max() + 1
    approx[4, 17] = float("nan")
    margin = torch.rand(7, generator=g) * 2
    rows, toks = _candidates(approx, margin)
    approx = approx.float()
    best = approx.amax(dim=1)
    want_rows, want_toks = torch.nonzero(approx >= (best - margin)[:, None], as_tuple=True)
    assert torch.equal(rows, want_rows) and torch.equal(toks, want_toks)
    assert 4 not in rows.tolist() and 1001 in toks[rows == 2].tolist()


def test_settle_runs_a_row_counts_timing_trials_at_once():
    from logitspec.kernels import onednn
    from logitspec.worker.head import has_fbgemm
    if not (has_fbgemm() and onednn.available()):
        pytest.skip("one screen pass only: nothing to time")
    screen = _Screen(torch.randn(300, 16), kind="auto")
    assert screen._bucket(6) not in screen.choices()
    screen.settle(6)
    assert screen.choices()[screen._bucket(6)] in screen.passes


def test_rescore_kernel_computes_each_candidates_logit():
    from logitspec.worker.head import _rescore
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(500, 37, generator=g), torch.randn(4, 37, generator=g)  # H not a multiple of 8
    rows, toks = torch.tensor([0, 0, 3, 2, 3]), torch.tensor([5, 499, 0, 17, 17])
    got = _rescore(weight, x, rows, toks)
    torch.testing.assert_close(got, (weight[toks] * x[rows]).sum(dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(_rescore(weight, x, rows[2:3], toks[2:3]), got[2:3])  # a candidate's value is its own
