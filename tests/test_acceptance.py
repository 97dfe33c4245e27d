"""The fast acceptance paths against the reference rule (verify.reference_accept), without a model:
one step of rows with different settings (greedy and sampled three ways), walked on the host or
decided where the logits are, gives each row the reference's path and bonus token, and leaves its
generator where the reference leaves it."""
import numpy as np
import pytest
import torch

from logitspec.sample.acceptance import accept_step, next_guesses, reference_accept
from logitspec.sample.node_logits import NodeLogits
from logitspec.sample.params import SamplingParams
from logitspec.spec_decode.tree import DraftTree, TreeBuilder
from logitspec.worker.eager_runner import ForwardResult
from logitspec.worker.masks import StepRow, pack

V = 7
PARAMS = [SamplingParams(), SamplingParams(0.8, top_p=0.9), SamplingParams(1.2, top_k=3), SamplingParams(),
          SamplingParams(0.8, top_p=0.9), SamplingParams(0.5)]


def _tree(rng) -> DraftTree:
    b = TreeBuilder(int(rng.integers(0, V)), int(rng.integers(0, 12)))
    for _ in range(4):
        chain = rng.integers(0, 3, int(rng.integers(1, 4))).tolist()  # few tokens: walks go deep
        b.add_chain(chain, parent=int(rng.integers(0, len(b.tokens))))
    return b.build()


def _step(seed: int):
    rng = np.random.default_rng(seed)
    trees = [_tree(rng) for _ in PARAMS]
    rows = [StepRow.from_tree(10 + i, t) for i, t in enumerate(trees)]
    packed = pack(rows, 40, {"full_attention": None}, torch.float32)
    T = packed.ids.shape[1]
    sizes = [len(t) for t in trees]
    scores = torch.randn(sum(sizes), V, generator=torch.Generator().manual_seed(seed)) * 2
    scores[:, :3] += 2.0  # the drafted tokens are likely
    select = torch.cat([torch.arange(b * T, b * T + n) for b, n in enumerate(sizes)])
    starts = np.cumsum([0] + sizes[:-1])
    spans = [(int(a), int(a) + n) for a, n in zip(starts, sizes)]
    fwd = ForwardResult(NodeLogits(scores, exact=True), packed, select, torch.tensor(starts), spans, 0.0)
    return trees, fwd


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_mixed_rows_accept_as_the_reference(seed, on_host):
    trees, fwd = _step(seed)
    gens = [None if p.greedy else torch.Generator().manual_seed(seed * 10 + b) for b, p in enumerate(PARAMS)]
    ref_gens = [None if g is None else torch.Generator().manual_seed(seed * 10 + b)
                for b, g in enumerate(gens)]
    want = [reference_accept(t, lg, p, g) for t, lg, p, g in zip(trees, fwd.logits, PARAMS, ref_gens)]
    r = accept_step(trees, fwd, PARAMS, gens, 2, on_host, outputs=True)
    paths, bonus, top, outputs = r.paths, r.bonus, r.top, r.outputs
    assert list(zip(paths, bonus)) == want
    for p, lg, row in zip(PARAMS, fwd.logits, outputs):  # greedy rows: each node's argmax
        assert not p.greedy or row == lg.scores.argmax(-1).tolist()
    for g, r in zip(gens, ref_gens):  # one uniform per emitted token, as the reference
        assert g is None or torch.equal(g.get_state(), r.get_state())
    guesses = next_guesses(fwd.logits, paths, bonus, top, 2)
    for lg, p, b, gs in zip(fwd.logits, paths, bonus, guesses):
        best = torch.sort(lg.scores[p[-1]], descending=True, stable=True).indices.tolist()
        assert gs == [t for t in best if t != b][:2]
