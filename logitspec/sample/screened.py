"""Exact sampling from the screened (half-precision) output layer.

The screen (:class:`~logitspec.worker.head.ScreenedArgmax`) gives approximate logits ``a`` with
``|a_v - z_v| <= B`` for every token, ``z`` the float32 logits. A draw is made by inverse CDF: one
uniform ``u`` from the sequence's generator, over the support ranked by float32 logit (descending,
ties by lowest id). It needs float32 logits only where ``a`` and ``B`` cannot decide (proof in
docs/engine.md, "Exact sampling from the screen"):

* the candidate set C is the m best tokens by ``a``; each token outside it weighs (``exp(z / T)``)
  between ``exp((a_v - B) / T)`` and ``exp((a_v + B) / T)``, and ranks below every token of C whose
  float32 logit exceeds ``min_C a + B`` (the "safe" tokens);
* temperature only: the token where the ranked masses cross ``u x total`` is known when that crossing
  is the same safe token for both bounds on the total;
* top-k: every token of the float32 top-k has ``a_v >= a_(k) - 2 B``; those are rescored;
* top-p: the nucleus edge is known where the bounds on the total put it at the same safe token;
* otherwise C grows (``GROW``), up to the whole vocabulary (the full float32 row).

A draw is a function of the float32 logits and ``u`` only: never of the screen's rounding, the
candidate set's size, or the other rows of the batch (whose count picks the float16 pass).

The uniform comes from :mod:`logitspec.sample.sampler`, which draws every token; a node whose output is
full float32 rows (no screen: soft-capped logits, half precision, ``OutputMode.EXACT`` forwards) is drawn
from them with :func:`~logitspec.sample.sampler.token_at`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from logitspec.sample.params import SamplingParams

GROW = (64, 1024, 16384)  # candidate set sizes tried before the whole vocabulary
CHUNK = 8192  # rows of the weight gathered at once when rescoring
EPS = 1e-9  # relative slack on float64 sums of exponentials (their rounding is ~1e-11 here)
TAIL_SLACK = 1e-4  # relative slack on the tail bounds (float32 exponentials: error < 3e-5)
TINY = 1e-37  # per token: covers float32 exponentials that underflow to 0


def exact_logits(weight: torch.Tensor, x: torch.Tensor, toks: torch.Tensor | None) -> torch.Tensor:
    """float32 logits [K] of tokens ``toks`` [K] (None: all V) for one hidden state ``x`` [H]: the
    same float32 dot products as the greedy screen's rescoring, each independent of the others."""
    if toks is None:
        return torch.cat([(weight[i:i + CHUNK] * x).sum(dim=1) for i in range(0, weight.shape[0], CHUNK)])
    return torch.cat([(weight[toks[i:i + CHUNK]] * x).sum(dim=1) for i in range(0, len(toks), CHUNK)])


@dataclass
class Ranked:
    """Rescored candidates, best first (ties: lowest id first), and what is known of the rest."""

    tokens: torch.Tensor  # [K] int64
    logits: torch.Tensor  # [K] float32
    mass: torch.Tensor  # [K] float64: exp((logit - shift) / T)
    safe: int  # the first ``safe`` rank above every token outside the candidates
    tail: tuple[float, float]  # bounds on the outside tokens' total mass; (0, 0): no outside token
    rescored: int  # float32 logits computed to get here (V: the full row)

    def head(self, n: int) -> "Ranked":
        """The n best candidates as a fully known support."""
        return Ranked(self.tokens[:n], self.logits[:n], self.mass[:n], n, (0.0, 0.0), self.rescored)


def rank(toks: torch.Tensor, z: torch.Tensor, shift: float, T: float, safe_above: float,
         tail: tuple[float, float], rescored: int) -> Ranked:
    """Candidates ``toks`` [K] with float32 logits ``z`` [K], ranked."""
    by_id = torch.argsort(toks)
    order = by_id[torch.sort(z[by_id], descending=True, stable=True).indices]
    z = z[order]
    safe = int((z > safe_above).sum())
    return Ranked(toks[order], z, torch.exp((z.double() - shift) / T), safe, tail, rescored)


def candidate_rounds(approx: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bound: float,
                     T: float) -> Iterator[Ranked]:
    """The best m tokens by ``approx`` [V] rescored, for m in ``GROW`` and then the whole vocabulary."""
    V = approx.shape[0]
    shift = float(approx.max())
    low = torch.exp((approx - (shift + bound)) / T)  # [V] float32: exp((z - shift) / T) >= low
    grow = float(torch.exp(torch.tensor(2 * bound / T, dtype=torch.float64)))
    for m in [s for s in GROW if s < V]:
        top = torch.topk(approx, m)
        lo = float(low.index_fill(0, top.indices, 0.0).sum(dtype=torch.float64))
        tail = (lo * (1 - TAIL_SLACK), lo * grow * (1 + TAIL_SLACK) + TINY * V)
        safe_above = float(top.values[-1]) + bound
        yield rank(top.indices, exact_logits(weight, x, top.indices), shift, T, safe_above, tail, m)
    yield rank(torch.arange(V), exact_logits(weight, x, None), shift, T, float("-inf"), (0.0, 0.0), V)


def nucleus_size(r: Ranked, top_p: float) -> int | None:
    """Tokens of ``r`` in the nucleus (a token is in iff the mass ranked before it is < top_p x the
    total), or None if the bounds cannot tell."""
    before = torch.cat([r.mass.new_zeros(1), torch.cumsum(r.mass, 0)[:-1]])  # [K] exclusive prefix sums
    total = float(r.mass.sum())
    if r.tail == (0.0, 0.0):
        return int((before < top_p * total).sum())  # everything is known: the plain rule
    surely_in = before[:r.safe] < top_p * (total + r.tail[0]) * (1 - EPS)
    j = r.safe if bool(surely_in.all()) else int(surely_in.logical_not().nonzero()[0])
    if j < r.safe and float(before[j]) >= top_p * (total + r.tail[1]) * (1 + EPS):
        return j
    return None


def quantile(r: Ranked, u: float) -> int | None:
    """Rank of the token where the cumulative mass first exceeds ``u`` x the total, or None if the
    bounds cannot tell."""
    cum = torch.cumsum(r.mass, 0)  # [K]
    total = float(cum[-1])
    if r.tail == (0.0, 0.0):
        at = torch.tensor([u * total], dtype=torch.float64)
        i = min(int(torch.searchsorted(cum, at, right=True)), len(cum) - 1)
        while i > 0 and r.mass[i] == 0:  # rounding at the top edge: step back to a real token
            i -= 1
        return i
    ends = torch.tensor([u * (total + r.tail[0]) * (1 - EPS), u * (total + r.tail[1]) * (1 + EPS)],
                        dtype=torch.float64)
    i, j = torch.searchsorted(cum, ends, right=True).tolist()
    return i if i == j and j < r.safe else None


def top_p_support(approx, x, weight, bound: float, T: float, top_p: float) -> Ranked:
    """The nucleus of ``softmax(z / T)``, ranked, from approximate logits ``approx`` [V]."""
    for r in candidate_rounds(approx, x, weight, bound, T):
        n = nucleus_size(r, top_p)
        if n is not None:
            return r.head(n)
    raise AssertionError("unreachable: the whole vocabulary always decides")


def top_k_support(approx, x, weight, bound: float, T: float, k: int) -> Ranked:
    """The float32 top-k (tokens tied with the k-th included), ranked, from ``approx`` [V]."""
    cand = torch.nonzero(approx >= torch.topk(approx, k).values[-1] - 2 * bound).squeeze(1)  # [C] holds it
    z = exact_logits(weight, x, cand)
    r = rank(cand, z, float(z.max()), T, float("-inf"), (0.0, 0.0), len(cand))
    return r.head(int((r.logits >= r.logits[k - 1]).sum()))


def screened_sample(approx: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bound: float,
                    params: SamplingParams, u: float) -> int:
    """The token :func:`~logitspec.sample.sampler.token_at` draws with uniform ``u`` from the
    target's distribution (temperature, top-k, then top-p) at a node with hidden state ``x`` [H],
    float32 output weight ``weight`` [V, H] and screened logits ``approx`` [V] erring by at most
    ``bound``."""
    T, V = params.temperature, approx.shape[0]
    if 0 < params.top_k < V:
        sup = top_k_support(approx, x, weight, bound, T, params.top_k)
        if params.top_p < 1.0:
            sup = sup.head(nucleus_size(sup, params.top_p))
    elif params.top_p < 1.0:
        sup = top_p_support(approx, x, weight, bound, T, params.top_p)
    else:
        for r in candidate_rounds(approx, x, weight, bound, T):
            i = quantile(r, u)
            if i is not None:
                return int(r.tokens[i])
    return int(sup.tokens[quantile(sup, u)])
