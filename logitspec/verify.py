"""Acceptance: which path of a verified draft tree to keep, and the bonus token after it.

Greedy keeps the longest path whose every token equals the target's argmax at its parent.
Sampling walks from the root, draws the target's token at the current node and moves to the child
carrying it, if any: for deterministic drafts this emits exactly the target's distribution, and it
draws one uniform number per emitted token, the same count as plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def accept_path(tree: DraftTree, next_token: Callable[[int], int]) -> tuple[list[int], int]:
    """Walk the tree: ``next_token(node)`` is the target's token after ``node``.

    Returns (accepted node indices from the root, bonus token). The root is always accepted.
    """
    path = [0]
    while True:
        tok = next_token(path[-1])
        child = tree.child(path[-1], tok)
        if child is None:
            return path, tok
        path.append(child)


def greedy_accept(tree: DraftTree, argmax: Sequence[int]) -> tuple[list[int], int]:
    """``argmax[i]``: the target's argmax token at node i."""
    return accept_path(tree, lambda node: int(argmax[node]))


def sampled_accept(tree: DraftTree, scores: torch.Tensor, params: "SamplingParams",
                   generator: torch.Generator) -> tuple[list[int], int]:
    """``scores`` [n, V]: the target's float32 logits at every node; one draw per visited node."""
    return accept_path(tree, lambda node: sample_token(probs_from_logits(scores[node], params), generator))


def accept(tree: DraftTree, node_logits, params: "SamplingParams",
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The acceptance rule: greedy or sampled by ``params``. ``node_logits``: the target's output at
    every node of ``tree`` (a :class:`~logitspec.head.NodeLogits`: ``argmax`` [n] and ``scores`` [n, V])."""
    if params.greedy:
        return greedy_accept(tree, node_logits.argmax.tolist())
    return sampled_accept(tree, node_logits.scores, params, generator)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 [V] probabilities after temperature, top-k, then top-p (HF's order)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = (sp.cumsum(-1) - sp) >= params.top_p
        p = p.scatter(0, si[drop], 0.0)
        p = p / p.sum()
    return p


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw: one uniform number per token, from this sequence's own generator."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = probs.double().cumsum(0)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    idx = min(int(torch.searchsorted(cdf, x, right=True).item()), probs.shape[0] - 1)
    while idx > 0 and probs[idx] == 0:  # rounding at the top edge: step back to a real token
        idx -= 1
    return idx
