"""REST's draft trie from continuations (:mod:`logitspec.spec_decode.rest` finds them): the continuations at
some positions of a token array (:func:`gather`), the matches of a context's suffix in the context
itself (:func:`context_matches`, the datastore of a row without one) and the trie of continuations cut
to its heaviest nodes (:func:`select_trie`). Pure numpy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["SEPARATOR", "context_matches", "gather", "select_trie"]

SEPARATOR = -1  # between documents in a token array; a continuation ends at one


def gather(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """int64 [k, length]: ``tokens[s : s + length]`` per start, -1 from the first separator or the
    end on; rows whose first token is -1 dropped."""
    starts = np.asarray(starts, dtype=np.int64)
    n = len(tokens)
    if len(starts) == 0 or length <= 0 or n == 0:
        return np.zeros((0, max(length, 0)), dtype=np.int64)
    idx = starts[:, None] + np.arange(length, dtype=np.int64)  # [k, L]
    out = np.asarray(tokens)[np.minimum(idx, n - 1)].astype(np.int64)
    out[idx >= n] = SEPARATOR
    out[np.cumsum(out < 0, axis=1) > 0] = SEPARATOR
    return out[out[:, 0] >= 0]


def context_matches(context: Sequence[int], max_span: int, min_span: int) -> tuple[int, np.ndarray]:
    """The sequence's own context as the datastore: the longest suffix of ``context`` (``min_span``..
    ``max_span`` tokens) that occurs earlier in it with at least one token after, and the positions
    just after each of its occurrences (int64, oldest first). ``(0, [])`` when none. O(n span)."""
    c = np.asarray(context, dtype=np.int64)
    n = len(c)
    if n < 2 or max_span < 1:
        return 0, np.zeros(0, dtype=np.int64)
    ends = np.flatnonzero(c[: n - 1] == c[n - 1])  # occurrences' last positions, each followed by a token
    lens = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    for k in range(1, min(max_span, n - 1)):
        e = ends[alive]
        ok = e - k >= 0
        ok[ok] = c[e[ok] - k] == c[n - 1 - k]
        alive = alive[ok]
        if not len(alive):
            break
        lens[alive] += 1
    span = int(lens.max()) if len(lens) else 0
    if span < min_span:
        return 0, np.zeros(0, dtype=np.int64)
    return span, ends[lens >= span] + 1


def select_trie(conts: np.ndarray, n_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """REST's trie of continuations ``conts`` (int [k, L], -1 padding, rows non-empty) cut to its
    ``n_nodes`` heaviest nodes: a node is a distinct prefix, its weight the number of rows that start
    with it. Ties: the shallower node, then the lexicographically first.

    Returns ``tokens``, ``parents`` (index into the returned nodes, -1: a child of the root) and
    ``depths`` (1 for the root's children), int64 [N], parents before children.
    """
    conts = np.asarray(conts, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if conts.ndim != 2 or len(conts) == 0 or n_nodes <= 0:
        return empty, empty, empty
    m, L = conts.shape
    c = conts[np.lexsort(conts.T[::-1])]  # rows in lexicographic order: a prefix's rows are contiguous
    tok, par, cnt, dep, first = [], [], [], [], []
    change = np.zeros(m, dtype=bool)
    prev = np.full(m, -1, dtype=np.int64)  # node of each row at the previous depth
    base = 0
    for d in range(L):
        col = c[:, d]
        change[0] = True
        change[1:] |= col[1:] != col[:-1]
        starts = np.flatnonzero(change)  # first row of each prefix of length d + 1
        counts = np.diff(np.append(starts, m))
        keep = col[starts] >= 0  # -1: the row ended before this depth
        if not keep.any():
            break
        k = int(keep.sum())
        s = starts[keep]
        tok.append(col[s])
        par.append(prev[s])
        cnt.append(counts[keep])
        dep.append(np.full(k, d + 1, dtype=np.int64))
        first.append(s)
        node = np.full(len(starts), -1, dtype=np.int64)
        node[keep] = base + np.arange(k)
        prev = node[np.cumsum(change) - 1]
        base += k
    tok, par, cnt, dep, first = (np.concatenate(a) for a in (tok, par, cnt, dep, first))
    order = np.lexsort((first, dep, -cnt))[:n_nodes]  # heaviest first; a parent precedes its children
    new = np.full(len(tok) + 1, -1, dtype=np.int64)  # old node -> new index; [-1] stays -1 (the root)
    new[order] = np.arange(len(order))
    parents = new[par[order]]
    if (parents >= np.arange(len(order))).any():
        raise AssertionError("REST trie selection is not ancestor-closed")
    return tok[order], parents, dep[order]
