"""Sampling through the engine: the screened host walk (the default on CPU) and the full float32 path
(``screened_sampling=False``) both emit the target's distribution (chi-square on the first three
tokens, drafts accepted by the walk included); draws depend only on the seed; the walk draws only at
the nodes it visits."""
import numpy as np
import pytest
import torch
from chi2 import chi2, chi2_limit
from tiny_models import VOCAB, repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.sample import screened as sampling
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import probs_from_logits
from logitspec.spec_decode.ngram_index import CorpusIndex
from logitspec.worker.head import ScreenedArgmax

pytestmark = [pytest.mark.skipif(not ScreenedArgmax.supported(torch.zeros(1, 1)),
                                 reason="no float16 kernels"),
              pytest.mark.usefixtures("one_thread")]  # one_thread: tests/conftest.py


DEPTH = 3  # tokens per sample: the prefill's draw, then a step whose tree the walk can follow
PARAMS = [SamplingParams(0.8, top_p=0.95), SamplingParams(1.0, top_k=5), SamplingParams(1.0)]


@pytest.fixture(scope="module")
def peaked():
    """A tiny Llama whose next-token distributions put most mass on a few tokens (so the first three
    tokens have few likely values), and a prompt without repeated tokens."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:12].tolist()


def _likely_drafts(model, prompt) -> CorpusIndex:
    """A reference that drafts, after each first token t, the target's most likely token after
    ``prompt + [t]``: fixed before any draw (so the walk stays exact), and often accepted."""
    with torch.no_grad():
        nxt = model(torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1].argmax(-1)  # [V]
    return CorpusIndex.build([prompt[-2:] + [t, int(nxt[t])] for t in range(VOCAB)])


def _reference(model, prompt, params, floor=1e-4) -> dict[tuple, float]:
    """Exact probabilities of the first DEPTH sampled tokens from full float32 forwards: every
    sequence whose prefixes all weigh >= ``floor`` is a cell, the rest is one cell (key ())."""
    cells, rest = {(): 1.0}, 0.0
    for _ in range(DEPTH):
        seqs = list(cells)
        with torch.no_grad():
            z = model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]  # [S, V]
        probs = probs_from_logits(z, params).double()  # [S, V]
        grown = {}
        for s, row in zip(seqs, probs):
            joint = cells[s] * row  # [V]
            keep = joint >= floor
            rest += float(joint[~keep].sum())
            grown.update({s + (int(t),): float(joint[t]) for t in torch.nonzero(keep).squeeze(1)})
        cells = grown
    cells[()] = rest
    return cells


CASES = [(p, True) for p in PARAMS] + [(PARAMS[0], False)] + [
    pytest.param(p, False, marks=pytest.mark.slow) for p in PARAMS[1:]]


@pytest.mark.parametrize("params,screened", CASES, ids=lambda v: ("screened" if v else "full") if v in (True,
                                                                                                        False)
                         else f"T{v.temperature}-p{v.top_p}-k{v.top_k}")
def test_engine_samples_the_target_distribution(peaked, params, screened):
    """Chi-square of the first three tokens of 800 seeded samples against the exact distribution."""
    model, prompt = peaked
    ref = _reference(model, prompt, params)
    n = 800
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=16, budget="fixed"),
                    screened_sampling=screened)
    res = engine.generate([prompt] * n, max_new_tokens=DEPTH, temperature=params.temperature,
                          top_p=params.top_p,
                          top_k=params.top_k, seed=list(range(1000, 1000 + n)),
                          reference=_likely_drafts(model, prompt))
    keys = list(ref)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.bincount([index.get(tuple(r.token_ids), index[()]) for r in res], minlength=len(keys))
    stat, df = chi2(counts, np.array([ref[k] for k in keys]), n)
    assert stat < chi2_limit(df), (stat, df)
    followed = sum(r.stats["accepted_lengths"][1] > 1 for r in res)  # the walk accepted a drafted token
    assert followed > n // 10, followed


@pytest.mark.parametrize("kw", [dict(temperature=0.9, top_p=0.95), dict(temperature=1.0, top_k=10)], ids=str)
def test_engine_draws_depend_only_on_the_seed(kw):
    """A row's tokens are the same alone, batched with others, and in ``ar`` (one uniform per token)."""
    model = tiny_model("gemma3")
    prompts = repetitive_prompts(4, seed=5)
    kw = dict(max_new_tokens=12, seed=[21, 22, 23, 24], **kw)
    solo = [Engine(model, None, SpecConfig(method="logitspec")).generate([p],
                                                                         **{**kw, "seed": [s]})[0].token_ids
            for p, s in zip(prompts, kw["seed"])]
    batched = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=3)).generate(prompts, **kw)
    assert [r.token_ids for r in batched] == solo
    ar = Engine(model, None, SpecConfig(method="ar", max_batch_size=2)).generate(prompts, **kw)
    assert [r.token_ids for r in ar] == solo


def test_the_walk_draws_only_at_visited_nodes(peaked, monkeypatch):
    """One screened draw per emitted token (the nodes the walk visits), none at the other nodes."""
    model, prompt = peaked
    calls = []
    real = sampling.screened_sample
    monkeypatch.setattr(sampling, "screened_sample", lambda *a: calls.append(1) or real(*a))
    engine = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2, budget="fixed"))
    res = engine.generate([prompt] * 3, max_new_tokens=16, temperature=0.8, top_p=0.95, seed=4)
    emitted = sum(len(r.token_ids) for r in res)
    # nodes the forwards computed: each step's root (the prefill's last token first) and its draft nodes
    nodes = sum(r.stats["steps"] + r.stats["mean_tree_size"] * (r.stats["steps"] - 1) for r in res)
    assert len(calls) == emitted
    assert nodes > 2 * emitted  # the trees held far more nodes than the walk visited
