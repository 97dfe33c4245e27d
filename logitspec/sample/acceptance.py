"""Acceptance: which path of a verified draft tree to keep, and the bonus token after it.

Greedy keeps the longest path whose every token equals the target's argmax at its parent.
Sampling walks from the root, draws the target's token at the current node and moves to the child
carrying it, if any: for deterministic drafts this emits exactly the target's distribution, and it
draws one uniform number per emitted token, the same count as plain decoding.

Four ways to run the rule, one result: :func:`reference_accept` (one tree, every node's output
at hand: the plain rule, for tests), :func:`walk` (the host walk: a draw only at the nodes it
visits, from the screen where there is one), :func:`decide` (all rows of a step where the
logits are, one transfer to the host) and :func:`greedy_decision` (a greedy step inside the graph
runner's step, from every node's scores; read with :func:`read_decision`). :func:`accept_step` picks
per row, so rows with different settings share a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from logitspec.device import to_device
from logitspec.sample.node_logits import NodeLogits
from logitspec.sample.params import SamplingParams
from logitspec.sample.sampler import (
    next_token,
    node_choices,
    probs_from_logits,
    sample_token,
    top_tokens,
    tree_uniforms,
)
from logitspec.spec_decode.tree import DraftTree


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
    """Sampled acceptance of ``tree`` with a draw (:func:`~logitspec.sample.sampler.next_token`) at each
    node the walk visits, none at the others. Returns (accepted node indices from the root, bonus)."""
    return accept_path(tree, lambda node: next_token(nodes, node, params, generator))


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
           override_last: Sequence[int] | None = None) -> StepDecision:
    """Acceptance of all rows of a step where its logits are, with one transfer to the host.

    ``nodes``: the output of the N nodes of the :class:`~logitspec.worker.masks.PackedStep` ``packed``, at
    the flat [B x T] positions ``select`` [N] (row b's nodes from ``starts[b]`` [B] on).
    ``params``: every row's settings, or one per row (with ``spans``, the rows' node ranges; None:
    a row decided elsewhere, whose result here is meaningless). Sampling draws node i's token with
    ``uniforms[i]`` [N] float64, the draw of its depth: the walk visits one node per depth, so each
    emitted token uses the sequence's next uniform exactly as :func:`sampled_accept` does.
    ``outputs``: also per row the target's token after each of its nodes, in the same transfer (the
    choice of greedy rows; the argmax of sampled rows' scores, never a draw: drafts built from them
    must not depend on the target's random draws). ``override_last``: per row the node to accept
    instead of the rule's (greedy rows; the policy's ``accept_override``); the bonus and top tokens
    are then the target's at that node, and the device does the same work as without it."""
    choice = node_choices(nodes, params, uniforms, spans)  # [N]
    B, T = packed.ids.shape
    pad = torch.full((B * T,), -1, dtype=torch.int64, device=choice.device)
    # [B, T]: the target's token after each node
    pad = pad.index_copy_(0, select, choice.to(torch.int64)).view(B, T)
    last = accepted_last(pad, packed)  # [B]
    if override_last is not None:
        last = to_device(np.asarray(override_last, dtype=np.int64), last.device)  # [B]
    cols = [last[:, None], pad.gather(1, last[:, None])]
    if top_k:
        cols.append(top_tokens(nodes.scores, starts + last, top_k + 1))  # [B, top_k + 1]
    if outputs:
        cols.append(_drafting_choices(nodes, choice, params, spans, select, B * T).view(B, T))  # [B, T]
    host = torch.cat(cols, dim=1).tolist()  # the step's one wait for the device
    k = top_k + 1 if top_k else 0
    outs = [r[2 + k:] for r in host] if outputs else None
    return StepDecision([r[0] for r in host], [r[1] for r in host], [r[2:2 + k] for r in host], outs)


def greedy_decision(choice: torch.Tensor, packed, top: int,
                    top_at: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A greedy step decided on the device from the target's token after every node of its [B, T]
    batch (``choice`` [B, T], the argmax; what a graph runner's step computes inside its graph):
    [B, 2 + top + T] int64, per row the last accepted node, the bonus token, the ``top`` best tokens
    of the last node (``top_at(flat positions [B]) -> [B, top]``, best first; row b's node i at
    b * T + i) and ``choice``. Pad nodes are never accepted (:func:`accepted_last`); fixed shapes, no
    host read: capturable."""
    B, T = choice.shape
    last = accepted_last(choice, packed)  # [B]
    cols = [last[:, None], choice.gather(1, last[:, None])]
    if top:
        at = torch.arange(B, device=last.device) * T + last  # [B]: the last nodes' flat positions
        cols.append(top_at(at))  # [B, top]
    return torch.cat(cols + [choice], dim=1)


def read_decision(decision: torch.Tensor, rows: int, top: int, top_k: int, outputs: bool,
                  ready=None) -> StepDecision:
    """:func:`decide`'s result from a :func:`greedy_decision` of ``top`` top tokens: its first ``rows``
    rows copied to the host (the step's one wait for the device: on ``ready``, a CUDA event, where the
    runner copied it to host memory already), ``top_k + 1`` top tokens kept."""
    if ready is not None:
        ready.synchronize()
    host = decision[:rows].tolist()
    k = top_k + 1 if top_k else 0
    if k > top:
        raise ValueError(f"{k} top tokens asked of a decision that holds {top}")
    outs = [r[2 + top:] for r in host] if outputs else None
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


# ---------------------------------------------------------------------------- one step, mixed rows
@dataclass
class AcceptResult:
    """What acceptance decided for the B rows of a step. Row b emits the draft tokens at
    ``paths[b][1:]`` (the *accepted* tokens: each the target's own choice at its parent), then
    ``bonus[b]`` (the target's token after the last accepted node: the *recovered* token where a draft
    was rejected there, the *bonus* token where the path ends at a leaf); ``len(paths[b])`` tokens
    in all, one uniform of the row's generator spent per token when sampling."""

    paths: list[list[int]]  # [B][accepted + 1]: node indices from the root (always 0) down
    bonus: list[int]  # [B]: the token emitted after the path
    top: list[list[int] | None]  # [B][top_k + 1]: the last accepted node's best tokens, where known
    outputs: list[list[int]] | None = None  # [B][n_b]: the target's token after every node, when asked


def accept_step(trees: Sequence[DraftTree], fwd, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None], top_k: int, on_host: bool,
                outputs: bool = False, override_last: Sequence[int] | None = None) -> AcceptResult:
    """Acceptance of every row of a step (:class:`AcceptResult`): ``top`` holds the ``top_k + 1``
    best tokens of each row's last accepted node where :func:`decide` found them (else None), and
    with ``outputs`` the target's token after each node (see :func:`decide`).
    Sampled rows are walked on the host when ``on_host`` (drawing only at the nodes they visit);
    the other rows are decided where the logits are, in one call. ``fwd``: the step's
    :class:`~logitspec.worker.eager_runner.ForwardResult`. ``override_last``: per row the node to accept
    (greedy rows
    only, see :func:`decide`)."""
    B = len(trees)
    paths: list = [None] * B
    bonus: list = [None] * B
    top: list = [None] * B
    outs: list = [None] * B
    walked = [b for b in range(B) if on_host and not params[b].greedy]
    if override_last is not None and not all(p.greedy for p in params):
        raise ValueError("an acceptance override needs greedy rows")
    if fwd.decision is not None and override_last is None and all(p.greedy for p in params):
        # decided with the forward, on the device: read it (the step's one wait)
        d = read_decision(fwd.decision, B, fwd.decision_top, top_k, outputs, fwd.decision_ready)
        paths = [t.path_to(n) for t, n in zip(trees, d.last)]
        top = [row if top_k else None for row in d.top]
        outs = [o[:len(t)] for o, t in zip(d.outputs, trees)] if outputs else None
        return AcceptResult(paths, list(d.bonus), top, outs)
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
                   override_last)
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
    return AcceptResult(paths, bonus, top, outs if outputs else None)


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
