"""Acceptance: which path of a verified draft tree to keep, and the bonus token after it.

Greedy keeps the longest path whose every token equals the target's argmax at its parent.
Sampling walks from the root, draws the target's token at the current node and moves to the child
carrying it, if any: for deterministic drafts this emits exactly the target's distribution, and it
draws one uniform number per emitted token, the same count as plain decoding.

Three ways to run the rule, one result: :func:`reference_accept` (one tree, every node's output
at hand: the plain rule, for tests), :func:`walk` (the host walk: a draw only at the nodes it
visits, from the screen where there is one) and :func:`decide` (all rows of a step where the
logits are, one transfer to the host). :func:`accept_step` picks per row, so rows with different
settings share a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .device import to_device
from .head import NodeLogits, top_tokens
from .request import SamplingParams
from .sampling import probs_from_logits, sample_token
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


# ---------------------------------------------------------------------------- the reference
def greedy_accept(tree: DraftTree, argmax: Sequence[int]) -> tuple[list[int], int]:
    """The reference greedy rule; ``argmax[i]``: the target's argmax token at node i."""
    return accept_path(tree, lambda node: int(argmax[node]))


def sampled_accept(tree: DraftTree, scores: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """The reference sampled rule; ``scores`` [n, V]: the target's float32 logits at every node; one
    draw per visited node."""
    return accept_path(tree, lambda node: sample_token(probs_from_logits(scores[node], params), generator))


def reference_accept(tree: DraftTree, node_logits: NodeLogits, params: SamplingParams,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """The acceptance rule in its plainest form, greedy or sampled by ``params``, with the target's
    output at every node of ``tree`` (``argmax`` [n] and float32 ``scores`` [n, V]): what the fast
    paths (:func:`walk`, :func:`decide`) are tested against."""
    if params.greedy:
        return greedy_accept(tree, node_logits.argmax.tolist())
    return sampled_accept(tree, node_logits.scores, params, generator)


# ---------------------------------------------------------------------------- on the host
def walk(tree: DraftTree, nodes: NodeLogits, params: SamplingParams,
         generator: torch.Generator) -> tuple[list[int], int]:
    """Sampled acceptance of ``tree`` with a draw (:meth:`~logitspec.head.NodeLogits.sample`) at each
    node the walk visits, none at the others. Returns (accepted node indices from the root, bonus)."""
    return accept_path(tree, lambda node: nodes.sample(node, params, generator))


def tree_uniforms(generators: list[torch.Generator], trees: list[DraftTree],
                  device) -> tuple[torch.Tensor, list[list]]:
    """Per node of every row (rows in order), the uniform its depth draws from the row's generator
    ([N] float64 on ``device``), and per row the generator's state after each draw."""
    u, states = [], []
    for gen, tree in zip(generators, trees):
        depths = tree.depths
        st, draws = [gen.get_state()], []
        for _ in range(int(depths.max()) + 1):
            draws.append(torch.rand((), generator=gen, dtype=torch.float64).item())
            st.append(gen.get_state())
        u.append(np.asarray(draws)[depths])
        states.append(st)
    return to_device(np.concatenate(u), torch.device(device)), states


# ---------------------------------------------------------------------------- all rows on the device
@dataclass
class StepDecision:
    """Per row of a step: the last accepted node, the bonus token after it and the top tokens of
    that node's scores (the next step's guesses come from them)."""

    last: list[int]
    bonus: list[int]
    top: list[list[int]]  # top_k + 1 tokens per row, best first; empty lists when top_k is 0
    outputs: list[list[int]] | None = None  # per row, the target's token after each node (when asked)


def decide(nodes: NodeLogits, packed, select: torch.Tensor, starts: torch.Tensor,
           params: SamplingParams | Sequence[SamplingParams | None], uniforms: torch.Tensor | None,
           top_k: int, spans: Sequence[tuple[int, int]] | None = None, outputs: bool = False,
           forced_last: Sequence[int] | None = None) -> StepDecision:
    """Acceptance of all rows of a step where its logits are, with one transfer to the host.

    ``nodes``: the output of the N nodes of the :class:`~logitspec.masks.PackedStep` ``packed``, at
    the flat [B x T] positions ``select`` [N] (row b's nodes from ``starts[b]`` [B] on).
    ``params``: every row's settings, or one per row (with ``spans``, the rows' node ranges; None:
    a row decided elsewhere, whose result here is meaningless). Sampling draws node i's token with
    ``uniforms[i]`` [N] float64, the draw of its depth: the walk visits one node per depth, so each
    emitted token uses the sequence's next uniform exactly as :func:`sampled_accept` does.
    ``outputs``: also per row the target's token after each of its nodes, in the same transfer (the
    choice of greedy rows; the argmax of sampled rows' scores, never a draw: drafts built from them
    must not depend on the target's random draws). ``forced_last``: per row the node to accept
    instead of the rule's (replayed acceptance, :mod:`logitspec.replay`); the bonus and top tokens
    are then the target's at that node, and the device does the same work as without it."""
    choice = node_choices(nodes, params, uniforms, spans)  # [N]
    B, T = packed.ids.shape
    pad = torch.full((B * T,), -1, dtype=torch.int64, device=choice.device)
    # [B, T]: the target's token after each node
    pad = pad.index_copy_(0, select, choice.to(torch.int64)).view(B, T)
    last = accepted_last(pad, packed)  # [B]
    if forced_last is not None:
        last = to_device(np.asarray(forced_last, dtype=np.int64), last.device)  # [B]
    cols = [last[:, None], pad.gather(1, last[:, None])]
    if top_k:
        cols.append(top_tokens(nodes.scores, starts + last, top_k + 1))  # [B, top_k + 1]
    if outputs:
        cols.append(_drafting_choices(nodes, choice, params, spans, select, B * T).view(B, T))  # [B, T]
    host = torch.cat(cols, dim=1).tolist()  # the step's one wait for the device
    k = top_k + 1 if top_k else 0
    outs = [r[2 + k:] for r in host] if outputs else None
    return StepDecision([r[0] for r in host], [r[1] for r in host], [r[2:2 + k] for r in host], outs)


def _drafting_choices(nodes: NodeLogits, choice: torch.Tensor, params, spans, select: torch.Tensor,
                      size: int) -> torch.Tensor:
    """[size]: at each node's flat position, ``choice`` for greedy rows and the argmax of the scores
    for sampled ones (-1 at padding)."""
    if isinstance(params, SamplingParams):
        got = choice if params.greedy else nodes.scores.argmax(-1)
    else:
        greedy = np.concatenate([np.full(z - a, p is not None and p.greedy)
                                 for (a, z), p in zip(spans, params)])  # [N]
        got = torch.where(to_device(greedy, choice.device), choice, nodes.scores.argmax(-1))
    out = torch.full((size,), -1, dtype=torch.int64, device=choice.device)
    return out.index_copy_(0, select, got.to(torch.int64))


def node_choices(nodes: NodeLogits, params, uniforms: torch.Tensor | None,
                 spans: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """[N] the target's token after each node: the argmax for greedy rows, an inverse-CDF draw for
    sampled ones (rows grouped by their settings: one call per group); -1 for rows without settings."""
    if isinstance(params, SamplingParams):
        if params.greedy:
            return nodes.argmax
        return inverse_cdf(probs_from_logits(nodes.scores, params), uniforms)
    groups: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(params):
        if p is not None:
            groups.setdefault(p, []).append(b)
    if len(groups) == 1 and len(next(iter(groups.values()))) == len(params):
        return node_choices(nodes, next(iter(groups)), uniforms)
    device = nodes.scores.device
    choice = torch.full((nodes.scores.shape[0],), -1, dtype=torch.int64, device=device)
    for p, rows in groups.items():
        idx = to_device(np.concatenate([np.arange(*spans[b]) for b in rows]).astype(np.int64), device)
        part = nodes[idx]
        got = part.argmax if p.greedy else inverse_cdf(probs_from_logits(part.scores, p), uniforms[idx])
        choice.index_copy_(0, idx, got.to(torch.int64))
    return choice


def accepted_last(choice: torch.Tensor, packed) -> torch.Tensor:
    """[B] the deepest accepted node per row, ``choice`` [B, T] being the target's token after each
    node. A node passes when it carries its parent's choice and no earlier sibling carries it (the
    sibling :meth:`DraftTree.child` returns); it is accepted when it and all its ancestors pass, so
    the accepted nodes are :func:`accept_path`'s path."""
    ids, parents = packed.ids, packed.parents  # [B, T] each
    T = ids.shape[1]
    earlier = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril(-1)  # [T, T]: j < i
    same = (parents[:, :, None] == parents[:, None, :]) & (ids[:, :, None] == ids[:, None, :])  # [B, T, T]
    twin = (same & earlier).any(-1)
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


# ---------------------------------------------------------------------------- one step, mixed rows
def accept_step(trees: Sequence[DraftTree], fwd, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], top_k: int, on_host: bool,
                outputs: bool = False, forced_last: Sequence[int] | None = None):
    """Per row of a step: the accepted node path (root first), the bonus token after it, the
    ``top_k + 1`` best tokens of its last node's scores where :func:`decide` found them (else None),
    and with ``outputs`` the target's token after each of its nodes (see :func:`decide`; else None).
    Sampled rows are walked on the host when ``on_host`` (drawing only at the nodes they visit);
    the other rows are decided where the logits are, in one call. ``fwd``: the step's
    :class:`~logitspec.target.ForwardResult`. ``forced_last``: per row the node to accept (replayed
    acceptance: greedy rows only, see :func:`decide`)."""
    B = len(trees)
    paths: list = [None] * B
    bonus: list = [None] * B
    top: list = [None] * B
    outs: list = [None] * B
    walked = [b for b in range(B) if on_host and not params[b].greedy]
    if forced_last is not None and not all(p.greedy for p in params):
        raise ValueError("replayed acceptance needs greedy rows")
    if len(walked) < B:
        mine = [None if b in walked else params[b] for b in range(B)]
        drawn = [b for b in range(B) if mine[b] is not None and not mine[b].greedy]
        u, states = None, []
        if drawn:
            u, states = tree_uniforms([generators[b] for b in drawn], [trees[b] for b in drawn],
                                      fwd.nodes.scores.device)
            if len(drawn) < B:  # the drawn rows' uniforms at their nodes' places
                idx = np.concatenate([np.arange(*fwd.spans[b]) for b in drawn]).astype(np.int64)
                u = torch.zeros(fwd.nodes.scores.shape[0], dtype=torch.float64, device=u.device).index_copy_(
                    0, to_device(idx, u.device), u)
        same = mine[0] if all(p == mine[0] for p in mine) else mine
        d = decide(fwd.nodes, fwd.packed, fwd.select, fwd.starts, same, u, top_k, fwd.spans, outputs,
                   forced_last)
        for b in range(B):
            if mine[b] is not None:
                paths[b], bonus[b] = trees[b].path_to(d.last[b]), d.bonus[b]
                top[b] = d.top[b] if top_k else None
                outs[b] = d.outputs[b][:len(trees[b])] if outputs else None
        for b, st in zip(drawn, states):
            generators[b].set_state(st[len(paths[b])])  # one uniform consumed per emitted token
    if walked:
        logits = fwd.logits
        for b in walked:
            paths[b], bonus[b] = walk(trees[b], logits[b], params[b], generators[b])
            outs[b] = logits[b].scores.argmax(-1).tolist() if outputs else None
    return paths, bonus, top, (outs if outputs else None)


def next_guesses(logits: Sequence[NodeLogits], paths: Sequence[Sequence[int]], bonus: Sequence[int],
                 top: Sequence[list[int] | None], k: int) -> list[list[int]]:
    """Per row, the next step's ``k`` next-next guesses: the top-k of the last accepted node's scores
    (which chose the bonus token, excluded); ``top[b]``: those top-k + 1 tokens where known."""
    if k == 0:
        return [[] for _ in paths]
    top = list(top)
    missing = [b for b, t in enumerate(top) if t is None]
    if missing:
        last = torch.stack([logits[b].scores[paths[b][-1]] for b in missing])  # [M, V]
        for b, row in zip(missing, torch.topk(last, k + 1, dim=-1).indices.tolist()):  # [M][k + 1]
            top[b] = row
    return [[t for t in row if t != b][:k] for row, b in zip(top, bonus)]
