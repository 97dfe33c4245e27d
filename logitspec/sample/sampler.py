"""Every token the engine draws: the target's distribution under a row's :class:`SamplingParams`, one
uniform from the row's own generator per emitted token, by inverse CDF over token ids.

The same draw three ways, one result for a given float32 row and uniform: :func:`next_token` (one
node on the host: the first token after a prefill and the host walk of a tree; from the screen where
the output layer has one, :mod:`logitspec.sample.screened`), :func:`node_choices` (every node of a
step where the logits are, with :func:`tree_uniforms` drawn ahead on the host) and
:func:`sample_token` (a float32 probability row: the reference the tests compare against).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from logitspec.device import to_device
from logitspec.kernels import skinny
from logitspec.sample.params import SamplingParams

if TYPE_CHECKING:
    from logitspec.sample.node_logits import NodeLogits
    from logitspec.spec_decode.tree import DraftTree


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


def uniform(generator: torch.Generator) -> float:
    """The next uniform of a row's generator: one per emitted token."""
    return torch.rand((), generator=generator, dtype=torch.float64).item()


def token_at(probs: torch.Tensor, u: float) -> int:
    """The token where the cumulative mass of ``probs`` [V] first exceeds ``u`` x its total."""
    cdf = probs.double().cumsum(0)
    x = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    idx = min(int(torch.searchsorted(cdf, x, right=True).item()), probs.shape[0] - 1)
    while idx > 0 and probs[idx] == 0:  # rounding at the top edge: step back to a real token
        idx -= 1
    return idx


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from ``probs`` [V] with the next uniform of ``generator``."""
    return token_at(probs, uniform(generator))


def next_token(nodes: "NodeLogits", node: int, params: SamplingParams, generator: torch.Generator) -> int:
    """The target's token after ``node`` of ``nodes``: the float32 argmax when greedy, else a draw with
    one uniform from ``generator``, from the screen where the output is screened, else from the node's
    float32 row (the same token either way for a given float32 row)."""
    if params.greedy:
        return int(nodes.argmax[node])
    u = uniform(generator)
    if nodes.exact or nodes.hidden is None or nodes.screen is None:
        return token_at(probs_from_logits(nodes.scores[node], params), u)
    return nodes.screen.sample(nodes.scores[node], nodes.hidden[node], params, u)


def tree_uniforms(generators: Sequence[torch.Generator], trees: Sequence["DraftTree"],
                  device) -> tuple[torch.Tensor, list[list]]:
    """Per node of every row (rows in order), the uniform its depth draws from the row's generator
    ([N] float64 on ``device``), and per row the generator's state after each draw."""
    u, states = [], []
    for gen, tree in zip(generators, trees):
        depths = tree.depths
        st, draws = [gen.get_state()], []
        for _ in range(int(depths.max()) + 1):
            draws.append(uniform(gen))
            st.append(gen.get_state())
        u.append(np.asarray(draws)[depths])
        states.append(st)
    return to_device(np.concatenate(u), torch.device(device)), states


def node_choices(nodes: "NodeLogits", params, uniforms: torch.Tensor | None,
                 spans: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """[N] the target's token after each node: the argmax for greedy rows, an inverse-CDF draw with
    ``uniforms`` [N] for sampled ones (rows grouped by their settings: one call per group); -1 for rows
    without settings. ``params``: one :class:`SamplingParams` for all, or one per row (None: skipped)
    with ``spans``, the rows' node ranges."""
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


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[N] int64: per row of ``probs`` [N, V], the token :func:`token_at` draws with uniform ``u`` [N]
    float64 (on ``probs``' device); ``chunk`` rows at a time bound the float64 copies."""
    return torch.cat([_inverse_cdf(probs[i:i + chunk], u[i:i + chunk]) for i in range(0, len(probs), chunk)])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    V = probs.shape[-1]
    cdf = probs.double().cumsum(-1)  # [n, V]
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=V - 1)  # [n, 1]
    cols = torch.arange(V, device=probs.device)  # [V]
    # token_at's step back: the last token with probability at or before idx (0 if none)
    return torch.where((probs > 0) & (cols <= idx), cols, 0).amax(-1)


def scores_extension(scores: torch.Tensor):
    """The compiled CPU kernels for output scores ``scores`` (float32, or the bfloat16 screen pass's) on
    CPU, or None (then torch does the work)."""
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.bfloat16):
        return skinny.extension()
    return None


def top_tokens(scores: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] int64: per row ``rows[b]`` of ``scores`` [N, V], the tokens of its ``k`` largest
    scores, best first (the next-next guesses). On CPU the compiled kernel (one pass a row, no [B, V]
    gather; ties to the lower token), elsewhere ``torch.topk`` (its own order among ties)."""
    ext = scores_extension(scores)
    if ext is None:
        return torch.topk(scores[rows], k, dim=-1).indices
    return ext.top_tokens(scores.contiguous(), rows.to(torch.int64).contiguous(), k)
