"""Choosing how many draft nodes to verify: expected committed tokens per second of forward time.

A node's acceptance probability is estimated as the product, along its path, of running per-kind
acceptance rates (kind = branch 0 or a guess-rank bucket, and offset within the chain). For a
candidate size n, a row keeps its n most probable nodes (always an ancestor-closed set, since a
child is never more probable than its parent), and the expected tokens committed are
``1 + sum of their probabilities``. The chosen n maximises ``sum over rows / t(tokens in the forward)``,
with ``t`` from a measured cost curve (:mod:`logitspec.worker.calibrate`).

At batch (:func:`choose_sizes`) every row is padded to the widest row's node count in the decoder,
but the output layer runs only for real nodes; with the output layer's own cost per node measured
(``CostCurve.head``), each row gets its own count: the nodes worth their output-layer time, up to
the chosen width (rows that are copying get more, rows whose drafts are poor bets get none).
"""
from __future__ import annotations

import bisect
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np

from logitspec.spec_decode.tree import DraftTree

# acceptance-rate states by the drafted tokens a row's previous step accepted: 0, 1, 2-3, 4-7, >= 8.
# Inside a long copied span whole chains are accepted, and pooling those steps with ones that took 2
# tokens made a chain's deep nodes look like poor bets (measured: docs/results/longbench_sweep/report.md)
STREAK_BOUNDS = (1, 2, 4, 8)
N_STREAK_STATES = len(STREAK_BOUNDS) + 1


def streak_state(accepted: int) -> int:
    """The acceptance-rate state after a step that accepted ``accepted`` drafted tokens."""
    return bisect.bisect_right(STREAK_BOUNDS, accepted)


class AcceptanceStats:
    """P(node accepted | its parent accepted), per (state, kind, offset), with a Beta prior.

    ``state`` is what the caller knows before drafting, e.g. how many drafted tokens the sequence's
    previous step accepted: inside a copied span the next chain is a much better bet than after a miss.
    """

    def __init__(self, n_kinds: int, max_offset: int = 32, prior_hits: float = 1.0, prior_misses: float = 3.0,
                 kind_priors: dict[int, tuple[float, float]] | None = None, n_states: int = 1):
        """``kind_priors``: (hits, misses) for particular kinds (key ``kind``: in every state) or
        for a kind in one state (key ``(state, kind)``, applied after the former), e.g. an
        optimistic one for retrieved chains, so a fresh engine tries them (a rate is only learned
        from nodes that get verified)."""
        self.max_offset = max_offset
        self.hits = np.full((n_states, n_kinds, max_offset), prior_hits, dtype=float)
        self.tries = np.full((n_states, n_kinds, max_offset), prior_hits + prior_misses, dtype=float)
        items = sorted((kind_priors or {}).items(), key=lambda kv: isinstance(kv[0], tuple))
        for key, (h, m) in items:
            where = (slice(None), key) if not isinstance(key, tuple) else key
            self.hits[where], self.tries[where] = h, h + m

    def _cells(self, tree: DraftTree, nodes):
        return tree.kinds[nodes], np.minimum(tree.offsets[nodes], self.max_offset - 1)

    def node_probs(self, tree: DraftTree, state: int = 0) -> np.ndarray:
        """float64 [n]: estimated probability that each node ends on the accepted path (root: 1)."""
        n = len(tree)
        p = np.ones(n)
        if n > 1:
            k, o = self._cells(tree, np.arange(1, n))
            rate = self.hits[state, k, o] / self.tries[state, k, o]
            for i in range(1, n):
                p[i] = p[tree.parents[i]] * rate[i - 1]
        return p

    def update(self, tree: DraftTree, path: Sequence[int], state: int = 0) -> None:
        """Every node whose parent was accepted was tested; those on ``path`` passed."""
        self.update_step(Verified.of([tree], [path], [state]))

    def update_step(self, v: "Verified") -> None:
        """A step's tested nodes (:class:`Verified`) counted, every row at once."""
        offset = np.minimum(v.offsets, self.max_offset - 1)
        cells = (v.states * self.hits.shape[1] + v.kinds) * self.max_offset + offset  # a cell may repeat
        self.tries += np.bincount(cells, minlength=self.tries.size).reshape(self.tries.shape)
        self.hits += np.bincount(cells, v.passed, minlength=self.hits.size).reshape(self.hits.shape)


class Verified(NamedTuple):
    """The draft nodes a verified step tested (those whose parent was accepted), over all its rows."""

    states: np.ndarray  # int64 [T]: the row's acceptance state before the step
    kinds: np.ndarray  # int64 [T]
    offsets: np.ndarray  # int64 [T]: the node's index within its chain
    passed: np.ndarray  # bool [T]: on the accepted path
    first: np.ndarray  # bool [T]: a child of the root (a draft's first node)

    @classmethod
    def of(cls, trees: Sequence[DraftTree], paths: Sequence[Sequence[int]],
           states: Sequence[int]) -> "Verified":
        """From each row's tree, accepted path (root first) and state (rows of the root alone test
        nothing)."""
        rows = [b for b, t in enumerate(trees) if len(t) > 1]
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, empty.astype(bool), empty.astype(bool))
        sizes = np.array([len(trees[b]) for b in rows])
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # [R]: each row's root in the joined nodes
        parents = np.concatenate([trees[b].parents for b in rows])  # [N], row-local
        on_path = np.zeros(int(sizes.sum()), dtype=bool)
        on_path[np.concatenate([np.asarray(paths[b]) + s for b, s in zip(rows, start)])] = True
        row = np.repeat(np.arange(len(rows)), sizes)  # [N]
        tested = np.flatnonzero((parents >= 0) & on_path[np.maximum(parents, 0) + start[row]])
        kinds = np.concatenate([trees[b].kinds for b in rows])
        offsets = np.concatenate([trees[b].offsets for b in rows])
        return cls(np.asarray(states)[rows][row[tested]], kinds[tested], offsets[tested], on_path[tested],
                   parents[tested] == 0)


class CostCurve:
    """Forward time as a function of the number of new tokens in the batch (piecewise linear).

    ``batches``: optional curves measured with b > 1 rows, each over new tokens *per row*: b
    sequences with their own caches cost more than one sequence with as many tokens (measured: 8
    rows x 2 tokens 1.5x 8 rows x 1 token, where 16 tokens of one row cost 1.4x 8), and the draft
    budget must not underestimate it.
    """

    settled = True  # its measurement's control forward agreed with it (logitspec.worker.calibrate.measure)

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float], batches: dict | None = None,
                 head: dict | None = None, context: dict | None = None):
        """``head``: optional ``{"tokens": [N], "seconds": [s]}``, the output layer alone over N nodes
        (part of every forward time above, where each row's every node gets output-layer results).
        ``context``: optional ``{"per_column": s, "columns": c}``, the seconds a node's attention
        adds per cached column it reads beyond the ``c`` columns the curves were measured at
        (columns averaged over the layers: a sliding-window layer reads at most its window)."""
        order = np.argsort(tokens)
        self.tokens = [int(tokens[i]) for i in order]
        self.seconds = [float(seconds[i]) for i in order]
        self.batches = {int(b): c if isinstance(c, CostCurve) else CostCurve(c["tokens"], c["seconds"])
                        for b, c in (batches or {}).items()}
        self.head = None if head is None else CostCurve(head["tokens"], head["seconds"])
        self.context = dict(context) if context else None
        self._memo: dict = {}  # interpolations already made (step, widths)
        self._points = (np.asarray(self.tokens, float), np.asarray(self.seconds, float))  # for at()

    def head_time(self, nodes) -> np.ndarray:
        """Output-layer seconds for ``nodes`` (array) nodes; 0 without a head curve."""
        nodes = np.asarray(nodes, dtype=float)
        if self.head is None:
            return np.zeros_like(nodes)
        if len(self.head.tokens) == 1:
            return self.head.seconds[0] * nodes / self.head.tokens[0]
        return self.head.at(nodes)

    def __call__(self, n: int) -> float:
        """Seconds of a forward of ``n`` new tokens (flat below the first point, linear past the last)."""
        return float(self.at(n))

    def at(self, n) -> np.ndarray:
        """:meth:`__call__` over an array of token counts (float64, ``n``'s shape)."""
        n = np.asarray(n, dtype=float)
        x, y = self._points
        if len(x) == 1:
            return np.full(n.shape, y[0])
        slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.where(n > x[-1], y[-1] + slope * (n - x[-1]), np.interp(n, x, y))

    def step(self, rows: int, per_row: int, columns: float | None = None) -> float:
        """Forward time of ``rows`` sequences adding ``per_row`` tokens each: the measured batch
        curves, linear in ``rows`` between them and proportional beyond the largest; the token
        curve alone when no batch curve was measured. ``columns``: the cached columns the rows'
        nodes read (averaged over layers); beyond the curves' own, each node costs ``context``'s
        ``per_column`` more a column. (Each (rows, per_row) is interpolated once: the curve is fixed.)"""
        key = (rows, per_row)
        if key not in self._memo:
            self._memo[key] = float(self._steps(rows, per_row))
        return self._memo[key] + self.beyond(rows, per_row, columns)

    def widths(self, rows: int, most: int) -> tuple[np.ndarray, np.ndarray]:
        """For forwards of ``rows`` rows padded to 1 .. ``most`` draft nodes each: the decoder's
        seconds without the output layer, float64 [most], and the output layer's over ``rows + k``
        nodes for k = 0 .. rows * most, float64 [rows * most + 1] (what :func:`choose_sizes`
        prices). Kept per row count for the widest asked yet (the curve is fixed), read-only; the
        cached columns' part is :meth:`beyond`'s."""
        kept = self._memo.get(("widths", rows))
        if kept is None or len(kept[0]) < most:
            per_row = np.arange(2, most + 2)
            kept = (self._steps(rows, per_row) - self.head_time(rows * per_row),
                    self.head_time(rows + np.arange(rows * most + 1)))
            for a in kept:
                a.setflags(write=False)
            self._memo[("widths", rows)] = kept
        return kept[0][:most], kept[1][:rows * most + 1]

    def beyond(self, rows: int, per_row, columns: float | None):
        """The seconds ``rows`` rows of ``per_row`` new tokens add by reading ``columns`` cached
        columns beyond the curves' own (0 without a ``context`` measurement)."""
        if columns is None or not self.context:
            return 0.0
        return self.context["per_column"] * rows * per_row * max(0.0, columns - self.context["columns"])

    def _steps(self, rows: int, per_row):
        if rows <= 1 or not self.batches:
            return self.at(rows * per_row)
        sizes = sorted({1, *self.batches})

        def at(b: int) -> np.ndarray:
            return self.at(per_row) if b == 1 else self.batches[b].at(per_row)

        if rows in sizes:
            return at(rows)
        if rows > sizes[-1]:
            return at(sizes[-1]) * rows / sizes[-1]
        lo = max(b for b in sizes if b < rows)
        hi = min(b for b in sizes if b > rows)
        return at(lo) + (at(hi) - at(lo)) * (rows - lo) / (hi - lo)

    def monotone(self) -> "CostCurve":
        """This curve with its noise made harmless: no point costs less than a smaller one, in new
        tokens (per curve) and in rows (a batch curve at n tokens a row costs at least the next
        smaller batch's, and one row's, at n). A measured point below a smaller one is noise (a
        forward of more work does not cost less), and the budget would take it for free drafting:
        a calibration run here measured 16 rows x 2 tokens at 171 ms and 16 x 1 at 204."""
        def rising(c: "CostCurve", floor=None) -> "CostCurve":
            secs = np.maximum.accumulate([max(t, floor(n)) if floor else t for n, t in zip(c.tokens,
                                                                                           c.seconds)])
            return CostCurve(c.tokens, secs.tolist())
        one = rising(self)
        batches, below = {}, one
        for b in sorted(self.batches):
            batches[b] = below = rising(self.batches[b], floor=below)
        head = rising(self.head).to_dict() if self.head is not None else None
        return CostCurve(one.tokens, one.seconds, batches, head, self.context)

    def to_dict(self) -> dict:
        d = {"tokens": self.tokens, "seconds": self.seconds}
        if self.batches:
            d["batches"] = {str(b): c.to_dict() for b, c in sorted(self.batches.items())}
        if self.head is not None:
            d["head"] = self.head.to_dict()
        if self.context:
            d["context"] = dict(self.context)
        return d


def break_even(curve: CostCurve, rows: int, cost_scale: float = 1.0) -> float:
    """The acceptance rate at which one draft token per row pays at ``rows`` rows: a forward of 2
    tokens a row gives 1 + p tokens a row where one of 1 gives 1, so it pays when
    p > step(rows, 2) / step(rows, 1) - 1 (at least 1: no rate pays; nan for a curve of 0 s).
    ``cost_scale``: the learned correction of a drafting forward's time against a plain one's
    (:class:`~logitspec.spec_decode.feedback.Corrections`)."""
    one = curve.step(int(rows), 1)
    return max(0.0, curve.step(int(rows), 2) * cost_scale / one - 1.0) if one > 0 else math.nan


def choose_size(probs: Sequence[np.ndarray], cost: CostCurve, max_nodes: int) -> int:
    """Draft nodes per row (0..max_nodes) maximising expected committed tokens / forward time.

    ``probs[b]``: node probabilities of row b's draft nodes (root excluded), sorted descending.
    """
    B = len(probs)
    best_n, best = 0, B / cost.step(B, 1)
    cum = [np.concatenate([[0.0], np.cumsum(p[:max_nodes])]) for p in probs]
    for n in range(1, max_nodes + 1):
        T = 1 + max(min(n, len(p)) for p in probs)  # padded width of the forward
        gain = sum(1.0 + c[min(n, len(c) - 1)] for c in cum)
        score = gain / cost.step(B, T)
        if score > best:
            best_n, best = n, score
    return best_n


def choose_sizes(probs: Sequence[np.ndarray], cost: CostCurve, max_nodes: int,
                 weights: Sequence[float] | None = None, margin: float = 0.0,
                 columns: float | None = None, token_scale: float = 1.0, cost_scale: float = 1.0,
                 base: float | None = None) -> list[int]:
    """Draft nodes per row maximising expected committed tokens / forward time, rows apart.

    ``probs[b]``: row b's draft-node probabilities, sorted descending. ``weights[b]``: what a token
    of row b is worth (default 1 for every row; see :func:`drain_weights`); ``base``: what a plain
    step is worth (default the weights' sum: each row's token). Any drafting must score
    ``1 + margin`` times plain decoding. ``columns``: the cached columns the nodes read (see
    :meth:`CostCurve.step`). For each padded width W, the forward costs ``cost.step(B, W + 1)``
    less the output layer of the padding nodes; the rows' nodes (each row's first W) are then taken
    most probable first (a row's kept nodes are its most probable ones), each prefix scored: the
    smallest width with the best score wins. Without ``cost.head`` every node up to the width is free
    of extra cost, and this is :func:`choose_size` for every row. ``token_scale`` and ``cost_scale``:
    corrections learned from the steps so far (:class:`~logitspec.spec_decode.feedback.Realised`):
    each node's expected tokens, and a drafting forward's time against a plain one's, are multiplied
    by them. All widths are scored at once, from one sort of every row's nodes.
    """
    B = len(probs)
    w = np.ones(B) if weights is None else np.asarray(weights, dtype=float)  # [B]
    # drafting must beat plain decoding by the margin: the curve and the rates are estimates, and
    # a drafting step has host work (drafts, acceptance) that the curve does not hold
    base = w.sum() if base is None else float(base)
    plain = base / cost.step(B, 1, columns) * (1 + margin)
    lengths = np.array([min(len(p), max_nodes) for p in probs], dtype=np.int64)  # [B]
    W = int(lengths.max(initial=0))
    if W == 0:
        return [0] * B
    vals = np.full((B, W), -np.inf)  # [B, W]: each node's expected tokens, weighted by its row
    for b, p in enumerate(probs):
        vals[b, :lengths[b]] = np.asarray(p[:lengths[b]], dtype=float) * w[b] * token_scale
    flat = vals.reshape(-1)  # [B * W]
    order = np.argsort(-flat, kind="stable")  # stable: a row's nodes stay in their order
    ranked, depth = flat[order], order % W  # [B * W]: nodes most valuable first; each one's place in its row
    widths = np.arange(1, W + 1)  # [W]
    # at width i + 1 a row offers its first i + 1 nodes: the offered nodes in the same order
    offered = (depth[None] < widths[:, None]) & np.isfinite(ranked)[None]  # [W, B * W]
    kept = np.cumsum(offered, axis=1)  # [W, B * W]: nodes kept when the offered ones up to here are
    gain = base + np.cumsum(np.where(offered, ranked, 0.0), axis=1)  # [W, B * W]
    decoder, heads = cost.widths(B, W)  # [W] without the output layer, [B * W + 1]: it for B rows + k nodes
    decoder = decoder + cost.beyond(B, widths + 1, columns)
    score = np.where(offered, gain / ((decoder[:, None] + heads[kept]) * cost_scale), -np.inf)
    ends = np.argmax(score, axis=1)  # [W]: per width, the last node of the best prefix
    best, best_score = None, plain
    for i, end in enumerate(ends):  # the smallest width wins unless a wider one scores higher
        if score[i, end] > best_score * (1 + 1e-12):
            best, best_score = i, score[i, end]
    if best is None:
        return [0] * B
    chosen = order[:ends[best] + 1][offered[best, :ends[best] + 1]]
    return np.bincount(chosen // W, minlength=B).tolist()


def estimate(probs: Sequence[np.ndarray], sizes: Sequence[int], cost: CostCurve,
             columns: float | None = None) -> tuple[float, float]:
    """What :func:`choose_sizes`' model expects of keeping the ``sizes[b]`` first nodes of each
    row's ``probs[b]``: (accepted drafted tokens, forward seconds: the decoder padded to the widest
    row, the output layer over the kept nodes)."""
    B, width = len(probs), max(sizes, default=0)
    if width == 0:
        return 0.0, cost.step(B, 1, columns)
    tokens = sum(float(np.sum(p[:n])) for p, n in zip(probs, sizes))
    decoder, heads = cost.widths(B, width)
    return tokens, float(decoder[width - 1] + cost.beyond(B, width + 1, columns) + heads[sum(sizes)])


def drain_weights(remaining: Sequence[int], rates: Sequence[float], share: float,
                  end: float | Callable[[int], float] = 1.0, near: float = 0.9) -> np.ndarray:
    """What a drafted token of each row is worth, in plain steps, for a batch that is only draining
    (no prompt waits for a slot), float64 [B]; a plain step is worth 1 (``choose_sizes``' ``base``):
    it moves the batch's end one step.

    The batch ends with its slowest rows: those whose estimated steps left (``remaining`` tokens over
    their recent ``rates`` of tokens per step) are within ``near`` of the most. The end moves when all
    k of them gain, so each of their tokens is worth ``end(k) / k``, where ``end(k)`` is the cost of
    the batch's last steps (k rows) over a step's (a float: the same for every k): k tied rows that
    each gain g tokens move the end g steps, what throughput would count. (Valuing tied rows at a
    row's share, as an earlier rule did, left a static batch of equally long answers decoding
    plainly where verifying 8 nodes a row was 1.5x faster a step.) Any other row's token only makes
    the row finish sooner, saving its own part of each later step: worth ``share``, a row's
    marginal cost over the step's. A heuristic: a row's end of sequence is not known in advance,
    and the mean gain of tied rows stands for the smallest; a row without a recent rate counts one
    token a step."""
    rates = np.nan_to_num(np.asarray(rates, dtype=float), nan=1.0)
    est = np.asarray(remaining, dtype=float) / np.maximum(rates, 1e-9)  # [B]
    critical = est >= near * est.max()
    k = int(critical.sum())
    weights = np.full(len(est), float(np.clip(share, 0.0, 1.0)))
    cost = end(k) if callable(end) else end
    weights[critical] = max(float(cost), 0.0) / k
    return weights


def top_nodes(tree: DraftTree, probs: np.ndarray, n: int) -> DraftTree:
    """The sub-tree of the root and the ``n`` most probable draft nodes (ties: earlier first)."""
    keep = kept_nodes(probs, n)
    return tree if len(keep) == len(tree) - 1 else tree.subtree(keep)


def kept_nodes(probs: np.ndarray, n: int, also: int = 0, among: np.ndarray | None = None) -> list[int]:
    """The ``n`` most probable draft nodes of a tree (``probs``: [nodes], the root's first; ties:
    earlier first) together with the ``also`` most probable of the nodes ``among`` marks (bool
    [nodes]; some may be among the former), in ascending order: an ancestor-closed set, since no
    node is more probable than its parent."""
    rank = sorted(range(1, len(probs)), key=lambda i: (-probs[i], i))
    keep = set(rank[:n])
    if also:
        keep.update([i for i in rank if among[i]][:also])
    return sorted(keep)
