import numpy as np
import pytest
import torch

from logitspec.sample.acceptance import greedy_accept
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import probs_from_logits, sample_token
from logitspec.spec_decode.tree import DraftTree

TREE = DraftTree(np.array([7, 1, 2, 3, 4, 5]), np.array([-1, 0, 1, 2, 2, 0]))


@pytest.mark.parametrize("argmax,path,bonus", [
    ([1, 2, 4, 0, 9, 0], [0, 1, 2, 4], 9),  # follows 1 -> 2 -> 4, bonus after 4
    ([5, 0, 0, 0, 0, 6], [0, 5], 6),        # the second branch
    ([9, 0, 0, 0, 0, 0], [0], 9),           # nothing accepted: the bonus alone
    ([1, 8, 0, 0, 0, 0], [0, 1], 8),
])
def test_greedy_accept(argmax, path, bonus):
    assert greedy_accept(TREE, argmax) == (path, bonus)


def test_probs_top_k_top_p():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    p = probs_from_logits(logits, SamplingParams(1.0, 1.0, 2))
    assert p[:2].sum() == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(1.0, 0.7, 0))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_sample_token_never_picks_zero_probability():
    p = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = {sample_token(p, g) for _ in range(200)}
    assert draws == {1, 3}


def test_bad_sampling_values():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_tree_sampling_matches_target_distribution():
    """Chi-square check: sampling through a draft tree reproduces the target's two-token joint
    distribution, whatever the draft."""
    V = 4
    torch.manual_seed(0)
    root_p = torch.softmax(torch.randn(V) * 1.5, 0)
    child_p = torch.softmax(torch.randn(V, V) * 1.5, 1)  # distribution after first token t
    # draft: root -> 2 -> 1 and root -> 0 (deterministic)
    tree = DraftTree(np.array([9, 2, 1, 0]), np.array([-1, 0, 1, 0]))
    g = torch.Generator().manual_seed(123)
    n = 20000
    counts = np.zeros((V, V))
    for _ in range(n):
        def next_token(node):
            p = root_p if node == 0 else child_p[int(tree.tokens[node])]
            return sample_token(p, g)

        from logitspec.sample.acceptance import accept_path
        path, bonus = accept_path(tree, next_token)
        toks = [int(tree.tokens[i]) for i in path[1:]] + [bonus]
        if len(toks) < 2:  # the first token was the bonus: draw the second from the target directly
            toks.append(sample_token(child_p[toks[0]], g))
        counts[toks[0], toks[1]] += 1
    expected = (root_p[:, None] * child_p).numpy() * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    # 15 degrees of freedom: the 99.9% quantile is 37.7
    assert chi2 < 37.7, chi2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_tokens_are_a_stable_descending_sorts_first_k(dtype):
    """The next-next guesses: per selected row, the k best tokens, best first, ties to the lower token
    (bfloat16 scores tie often), as a stable sort gives them; a NaN never ranks; the kernel reads the
    rows in place (no gather), a row may be selected twice."""
    from logitspec.kernels import skinny
    from logitspec.sample.sampler import top_tokens
    if skinny.extension() is None:
        pytest.skip("the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(2)
    scores = (torch.randn(6, 1003, generator=g) * 4).round().to(dtype)  # many ties; V not a multiple of 8
    scores[4, 5] = float("nan")
    rows = torch.tensor([3, 0, 5, 3, 4])
    got = top_tokens(scores, rows, 33)
    want = torch.sort(torch.nan_to_num(scores[rows].float(), nan=-float("inf")), dim=1, descending=True,
                      stable=True).indices[:, :33]
    assert got.shape == (5, 33) and torch.equal(got, want)
    assert 5 not in got[4].tolist()
