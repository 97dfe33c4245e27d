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

from .head import top_tokens
from .request import SamplingParams
from .tree import DraftTree


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
    """float32 probabilities [..., V] after temperature, top-k, then top-p (HF's order), per row of
    ``logits`` [..., V]."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        drop = (sp.cumsum(-1) - sp) >= params.top_p
        p = p.masked_fill(torch.zeros_like(drop).scatter(-1, si, drop), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw: one uniform number per token, from this sequence's own generator."""
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cdf = probs.double().cumsum(0)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    idx = min(int(torch.searchsorted(cdf, x, right=True).item()), probs.shape[0] - 1)
    while idx > 0 and probs[idx] == 0:  # rounding at the top edge: step back to a real token
        idx -= 1
    return idx


# ---------------------------------------------------------------------------- all rows on the device
@dataclass
class StepDecision:
    """Per row of a step: the last accepted node, the bonus token after it and the top tokens of
    that node's scores (the next step's guesses come from them)."""

    last: list[int]
    bonus: list[int]
    top: list[list[int]]  # top_k + 1 tokens per row, best first; empty lists when top_k is 0


def decide(nodes, packed, select: torch.Tensor, starts: torch.Tensor, params: SamplingParams,
           uniforms: torch.Tensor | None, top_k: int) -> StepDecision:
    """Acceptance of all rows of a step where its logits are, with one transfer to the host.

    ``nodes``: the :class:`~logitspec.head.NodeLogits` of the N nodes of the
    :class:`~logitspec.masks.PackedStep` ``packed``, at the flat [B x T] positions ``select`` [N]
    (row b's nodes from ``starts[b]`` [B] on). Sampling draws node i's token with ``uniforms[i]``
    [N] float64, the draw of its depth: the walk visits one node per depth, so each emitted token
    uses the sequence's next uniform exactly as :func:`sampled_accept` does."""
    if params.greedy:
        choice = nodes.argmax  # [N]
    else:
        choice = inverse_cdf(probs_from_logits(nodes.scores, params), uniforms)  # [N]
    B, T = packed.ids.shape
    pad = torch.full((B * T,), -1, dtype=torch.int64, device=choice.device)
    pad = pad.index_copy_(0, select, choice.to(torch.int64)).view(B, T)  # [B, T]: the target's token after each node
    last = accepted_last(pad, packed)  # [B]
    cols = [last[:, None], pad.gather(1, last[:, None])]
    if top_k:
        cols.append(top_tokens(nodes.scores, starts + last, top_k + 1))  # [B, top_k + 1]
    host = torch.cat(cols, dim=1).tolist()  # the step's one wait for the device
    return StepDecision([r[0] for r in host], [r[1] for r in host], [r[2:] for r in host])


def accepted_last(choice: torch.Tensor, packed) -> torch.Tensor:
    """[B] the deepest accepted node per row, ``choice`` [B, T] being the target's token after each
    node. A node passes when it carries its parent's choice and no earlier sibling carries it (the
    sibling :meth:`DraftTree.child` returns); it is accepted when it and all its ancestors pass, so
    the accepted nodes are :func:`accept_path`'s path."""
    ids, parents = packed.ids, packed.parents  # [B, T] each
    T = ids.shape[1]
    earlier = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)  # [T, T]: j < i
    twin = ((parents[:, :, None] == parents[:, None, :]) & (ids[:, :, None] == ids[:, None, :]) & earlier).any(-1)
    fails = (parents >= 0) & ((ids != choice.gather(1, parents.clamp(min=0))) | twin)  # [B, T]
    accepted = ~(packed.visible & fails[:, None, :]).any(-1) & (packed.depths >= 0)  # [B, T]
    return torch.where(accepted, packed.depths, -1).argmax(dim=1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[N] int64: per row of ``probs`` [N, V], the token :func:`sample_token` draws with uniform
    ``u`` [N] float64 (on ``probs``' device); ``chunk`` rows at a time bound the float64 copies."""
    return torch.cat([_inverse_cdf(probs[i:i + chunk], u[i:i + chunk]) for i in range(0, len(probs), chunk)])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    V = probs.shape[-1]
    cdf = probs.double().cumsum(-1)  # [n, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)  # [n, 1]
    cols = torch.arange(V, device=probs.device)  # [V]
    # sample_token's step back: the last token with probability at or before idx (0 if none)
    return torch.where((probs > 0) & (cols <= idx), cols, 0).amax(-1)
