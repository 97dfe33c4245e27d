"""Exact sampling from the screened output layer: the target's distribution (temperature, top-k,
top-p), near-ties the float16 pass reorders, the fallback to the full row, seeds and batches."""
import numpy as np
import pytest
import torch
from chi2 import chi2, chi2_limit

from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import probs_from_logits, uniform
from logitspec.sample.screened import exact_logits, screened_sample, top_k_support, top_p_support
from logitspec.worker.head import ScreenedArgmax

pytestmark = pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(1, 1)), reason="no float16 kernels")


def _weights(V=64, H=32, seed=0, ties=12):
    """Random output weights with ``ties`` rows that copy another row up to 2e-4: their logits are
    closer than the float16 pass resolves, so it ranks some of them wrongly."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g)
    for i in range(ties):
        w[V - 1 - i] = w[i] + 2e-4 * torch.randn(H, generator=g)
    return w, g


def _node(screen, x):
    """(approx [V], bound) of one hidden state."""
    return screen.approx_logits(x[None])[0].float(), screen.bound_per_norm * float(x.norm())


def _reference_support(z, params):
    """The support after temperature, top-k, top-p, in float64 (rank: logit descending, then id)."""
    order = sorted(range(len(z)), key=lambda v: (-float(z[v]), v))
    keep = order[:params.top_k] if params.top_k else order
    if params.top_k:
        keep = [v for v in order if z[v] >= z[order[params.top_k - 1]]]
    mass = np.exp((np.array([float(z[v]) for v in keep], dtype=np.float64) - float(z[keep[0]]))
                  / params.temperature)
    before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
    return set(np.array(keep)[before < params.top_p * mass.sum()].tolist())


PARAMS = [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=5), SamplingParams(1.0,
                                                                                                 top_p=0.8),
          SamplingParams(0.8, top_p=0.95), SamplingParams(0.8, top_p=0.9, top_k=8)]


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_support_is_the_float32_support(params):
    """Over many hidden states, near-ties included, the screened support equals the one computed
    from the full float32 row."""
    w, g = _weights(V=300, ties=40)
    screen = ScreenedArgmax(w)
    for _ in range(60):
        x = torch.randn(32, generator=g) * 4
        a, bound = _node(screen, x)
        z = exact_logits(w, x, None)
        ref = _reference_support(z, params)
        if params.top_k:
            sup = top_k_support(a, x, w, bound, params.temperature, params.top_k)
            assert set(sup.tokens.tolist()) >= ref
        if params.top_p < 1 and not params.top_k:
            assert set(top_p_support(a, x, w, bound, params.temperature, params.top_p).tokens.tolist()) == ref


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_draws_follow_the_target_distribution(params):
    """Chi-square: screened draws against the float32 target (probs_from_logits), on a state whose
    best tokens are near-ties the float16 pass reorders."""
    w, g = _weights()
    x = torch.randn(32, generator=g) * 2
    win = int(exact_logits(w, x, None).argmax())
    w[(win + 7) % 64] = w[win] + 2e-4 * torch.randn(32, generator=g)  # a near-tie at the top
    screen = ScreenedArgmax(w)
    a, bound = _node(screen, x)
    probs = probs_from_logits(exact_logits(w, x, None), params).double().numpy()
    gen = torch.Generator().manual_seed(5)
    n = 3000
    draws = [screened_sample(a, x, w, bound, params, uniform(gen)) for _ in range(n)]
    counts = np.bincount(draws, minlength=64)
    assert counts[probs == 0].sum() == 0
    stat, df = chi2(counts, probs, n)
    assert stat < chi2_limit(df), (stat, df)


def test_undecided_nucleus_falls_back_to_the_full_row_and_stays_exact():
    """Nearly flat logits over 80 tokens: a 0.9 nucleus holds more than the first candidate set
    (64 tokens), so the full float32 row decides it."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 32, generator=g) * 0.02
    x = torch.randn(32, generator=g)
    screen = ScreenedArgmax(w)
    a, bound = _node(screen, x)
    params = SamplingParams(1.0, top_p=0.9)
    sup = top_p_support(a, x, w, bound, 1.0, 0.9)
    assert sup.rescored == 80
    z = exact_logits(w, x, None)
    assert set(sup.tokens.tolist()) == _reference_support(z, params)
    gen = torch.Generator().manual_seed(1)
    n = 1600
    for p in (params, SamplingParams(1.0)):  # temperature only: most quantiles lie past the candidates
        draws = [screened_sample(a, x, w, bound, p, uniform(gen)) for _ in range(n)]
        counts = np.bincount(draws, minlength=80)
        stat, df = chi2(counts, probs_from_logits(z, p).double().numpy(), n)
        assert stat < chi2_limit(df), (stat, df)
