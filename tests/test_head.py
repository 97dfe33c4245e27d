"""The screened greedy output layer: its argmax is the float32 argmax, near-ties included."""
import pytest
import torch

from logitspec.head import ScreenedArgmax

pytestmark = pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(1, 1)), reason="no fbgemm fp16 kernels")


def _reference(weight, x):
    return torch.nn.functional.linear(x, weight).argmax(dim=1)


def test_argmax_equals_float32_argmax_on_random_states():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=g) * 0.05
    x = torch.randn(200, 64, generator=g) * 20
    screen = ScreenedArgmax(weight)
    for rows in (slice(0, 1), slice(0, 7), slice(0, 200)):
        assert torch.equal(screen(x[rows]).argmax, _reference(weight, x[rows]))


def test_near_ties_below_half_precision_resolved_in_float32():
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
    assert (out.scores.argmax(dim=1) != ref).sum() >= 3  # the fp16 pass alone would be wrong
    assert torch.equal(out.argmax, ref)


def test_exact_ties_go_to_the_lowest_token_id():
    weight = torch.randn(100, 16)
    weight[70] = weight[10] = torch.ones(16) * 5
    x = torch.ones(3, 16)
    assert screen_argmax(weight, x) == [10, 10, 10]


def test_scores_approximate_the_logits():
    weight = torch.randn(1000, 48)
    x = torch.randn(5, 48)
    out = ScreenedArgmax(weight)(x)
    assert not out.exact
    torch.testing.assert_close(out.scores, x @ weight.T, rtol=0, atol=1e-2)


def test_non_finite_rows_fall_back_to_float32():
    weight = torch.randn(100, 16)
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    got = ScreenedArgmax(weight)(x).argmax
    assert got[0] == _reference(weight, x[:1])[0]
    assert 0 <= int(got[1]) < 100


def screen_argmax(weight, x):
    return ScreenedArgmax(weight)(x).argmax.tolist()
