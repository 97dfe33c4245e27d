"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", arXiv 2402.02057) as a drafter: a Jacobi window and an n-gram pool per row.

Each step verifies one tree rooted at the row's last token (the root) with two branches:

* the **lookahead branch**, a 2D window of ``N - 1`` levels (the Jacobi trajectory's last ``N - 1``
  iterations) over ``W`` columns: level 0 is a chain from the root (the trunk: root, ``W - 1``
  tokens); level ``l >= 1`` holds one token per column ``j`` (``W`` columns), hanging below the
  column's level ``l - 1`` token, or below trunk node ``j`` (the root for ``j = 0``) for ``l = 1``.
  A node at depth ``d`` sits at position root + ``d``: column ``j``, level ``l`` at root + ``j + l``.
* the **verification branch**: the pool's (up to ``G``) n-grams whose first token is the root, each
  a chain of ``N - 1`` tokens below the root.

After the forward the target's token after each node of the window's last level is the next
Jacobi iterate: for every column, the column's path (its trunk node, its levels 1..N-2) and that
token form an n-gram of ``N`` tokens, added to the pool under its first token (at most ``G`` per key,
the least recently added dropped first); the window then moves one column on (level 0 becomes level
1 without its first token, each level l the former l + 1, the new tokens the last level), whatever
the step accepted (LADE's ``ALWAYS_FWD_ONE``). The window starts as ``W + N - 3`` tokens drawn from
the prompt and warms up over ``N - 2`` steps (one level more each step, the trunk one token shorter)
before it yields n-grams; the pool starts empty (LADE's ``POOL_FROM_PROMPT = 0``).

Defaults ``W = 7, N = 5, G = 7``: LADE's README (hao-ai-lab/LookaheadDecoding, "lade.config_lade(
LEVEL=5, WINDOW_SIZE=7, GUESS_SET_SIZE=7)", its recommended configuration; ``update_token_map`` and
the multi-level window in ``lade/decoding.py`` are the algorithm followed here).

How it differs from the paper's implementation (one tree mask for every method):

* LADE's 2D mask (``j_make_causal_mask_multilevel``: a level-l token sees level 0 up to its column
  and the tokens above it in its column) *is* the ancestor mask of the tree above, with the same
  positions; so the window is not approximated. The verification candidates are merged into a trie
  (LADE verifies each as its own chain: the same accepted path, fewer nodes), and window nodes equal
  to candidate nodes (same parent, same token) are one node.
* Every node is verified by the acceptance rule, window nodes too: the trunk is a draft chain from
  the root (Jacobi decoding's own acceptance), so the window can add accepted tokens, never change
  the output. LADE accepts from the verification branch only.
* The tree's size is the method's, fixed by (W, N, G) (``fixed_shape``: ``budget`` "auto" or "fixed"
  and the batch scaling do not change it, as LADE's shape does not change; ``budget="auto"`` is
  LogitSpec's only, as for ``pld`` and ``rest``). Only the model's context caps it: a step with less
  room than the window drops the window whole (the window and pool then stay as they were) and the
  verification branch takes what room there is, most recent n-grams first, each cut at the cap (a
  cut n-gram is still a valid draft). A tree may hold more nodes than the row has tokens left.
* When sampling, the window advances with the argmax of each node's scores, as with greedy
  decoding (LADE's ``TEMP_FOR_GUESS = 0``): drafts never depend on the target's random draws.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from logitspec.spec_decode.interface import KIND, Drafter
from logitspec.spec_decode.tree import GUESS, DraftTree

WINDOW = 7  # W: columns of the Jacobi window (LADE WINDOW_SIZE)
LEVEL = 5  # N: n-gram size; the window keeps N - 1 levels (LADE LEVEL)
GUESS_SET = 7  # G: n-grams kept per first token and verified per step (LADE GUESS_SET_SIZE)


class NgramPool:
    """Per first token, up to ``size`` continuations of ``n - 1`` tokens; a new one beyond ``size``
    drops the least recently added (an n-gram added again counts as new: LADE's LRU)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size
        self.table: dict[int, list[tuple[int, ...]]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        if len(ngram) != self.n or self.size < 1:
            return
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        entries = self.table.setdefault(key, [])
        if rest in entries:
            entries.remove(rest)
        elif len(entries) >= self.size:
            entries.pop(0)
        entries.append(rest)

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key``, most recently added first."""
        return self.table.get(int(key), [])[::-1]

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


@dataclass
class Window:
    """The Jacobi window: ``levels[0]`` the trunk after the root; ``levels[l]`` (l >= 1) one token per
    column, ``len(levels[0]) + 1`` columns. Full (it yields n-grams) with ``n - 1`` levels."""

    levels: list[list[int]]
    n: int

    @classmethod
    def start(cls, prompt: Sequence[int], w: int, n: int, rng: np.random.Generator) -> "Window":
        """``w + n - 3`` tokens drawn from ``prompt`` as the trunk (LADE's ``copy_from``)."""
        pool = np.asarray(prompt, dtype=np.int64)
        return cls([[int(t) for t in rng.choice(pool, w + n - 3)]], n)

    @property
    def full(self) -> bool:
        return len(self.levels) == self.n - 1

    @property
    def size(self) -> int:
        """Its nodes in a draft tree (the root excluded), before any merge."""
        return len(self.levels[0]) + (len(self.levels) - 1) * (len(self.levels[0]) + 1)

    def paths(self) -> list[tuple[int, int, list[int]]]:
        """The window as chains to insert: (level, column of its parent, tokens). The trunk first
        (below the root, column -1), then each column's levels 1.. below its trunk node."""
        out = [(0, -1, list(self.levels[0]))]
        if len(self.levels) > 1:
            out += [(1, j, [lv[j] for lv in self.levels[1:]]) for j in range(len(self.levels[0]) + 1)]
        return out

    def advance(self, root: int, out: Sequence[int]) -> list[tuple[int, ...]]:
        """Move on one column, ``out`` being the target's tokens after the last level's nodes (the
        trunk's nodes but the root while warming up with one level); the n-grams of a full window
        (none while it warms up)."""
        L = self.levels
        if len(L) == 1:  # first warm-up step: the outputs after the trunk are level 1
            assert len(out) == len(L[0]), (len(out), len(L[0]))
            self.levels = [L[0][1:], [int(t) for t in out]]
            return []
        assert len(out) == len(L[0]) + 1, (len(out), len(L[0]))
        if not self.full:
            self.levels = [lv[1:] for lv in L] + [[int(t) for t in out[1:]]]
            return []
        trunk = [int(root)] + L[0]
        grams = [(trunk[j], *(lv[j] for lv in L[1:]), int(out[j])) for j in range(len(out))]
        self.levels = [L[1][1:]] + [list(lv) for lv in L[2:]] + [[int(t) for t in out]]
        return grams


@dataclass
class LookaheadState:
    """One row's lookahead state: its window and its n-gram pool."""

    window: Window
    pool: NgramPool
    steps: int = 0  # steps that advanced the window
    grams: int = 0  # n-grams collected


class _Trie:
    """Tokens and parents with merged shared prefixes, under a node capacity (root excluded)."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.kinds = [int(root)], [-1], [0]
        self.offsets: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]

    def insert(self, parent: int, chain: Sequence[int], kind: int, capacity: int) -> list[int]:
        """Nodes of ``chain`` below ``parent`` (existing ones reused); stops at ``capacity``."""
        nodes, node = [], parent
        for off, tok in enumerate(chain):
            tok = int(tok)
            nxt = self.children[node].get(tok)
            if nxt is None:
                if len(self.tokens) - 1 >= capacity:
                    break
                nxt = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(node)
                self.kinds.append(kind)
                self.offsets.append(off)
                self.children.append({})
                self.children[node][tok] = nxt
            nodes.append(nxt)
            node = nxt
        return nodes

    def tree(self, retrieved: bool) -> DraftTree:
        n = len(self.tokens)
        return DraftTree(np.asarray(self.tokens, dtype=np.int64), np.asarray(self.parents, dtype=np.int64),
                         retrieved=retrieved, kinds=np.asarray(self.kinds, dtype=np.int64),
                         offsets=np.asarray(self.offsets, dtype=np.int64),
                         origins=np.full(n, GUESS, dtype=np.int64))


def build_tree(root: int, window: Window | None, candidates: Sequence[Sequence[int]], budget: int,
               kinds: tuple[int, int] = (1, 1)) -> DraftTree:
    """The step's tree: the window (whole, if it fits in ``budget``), then the candidates (each cut
    at the budget). ``kinds``: the node kinds of window and candidate nodes (for acceptance
    statistics). ``retrieved``: a candidate added a node or shares one with the window."""
    trie = _Trie(root)
    trunk: list[int] = []
    if window is not None and window.size <= budget:
        for level, column, chain in window.paths():
            parent = 0 if column <= 0 else trunk[column - 1]
            nodes = trie.insert(parent, chain, kinds[0], budget)
            if level == 0:
                trunk = nodes
    retrieved = False
    for chain in candidates:
        retrieved |= bool(trie.insert(0, chain, kinds[1], budget))
    return trie.tree(retrieved)


def locate(tree: DraftTree, window: Window) -> list[list[int]] | None:
    """Per level of ``window``, its nodes in ``tree`` (level 0: the trunk but the root); None when
    the tree does not hold the whole window (it was dropped)."""
    trunk, node = [], 0
    for tok in window.levels[0]:
        node = tree.child(node, tok)
        if node is None:
            return None
        trunk.append(node)
    levels = [trunk]
    tops = [0] + trunk  # each column's trunk node
    for lv in window.levels[1:]:
        row = []
        for j, tok in enumerate(lv):
            node = tree.child(tops[j], tok)
            if node is None:
                return None
            row.append(node)
        levels.append(row)
        tops = row
    return levels


class LookaheadDrafter(Drafter):
    """Lookahead decoding (see the module): the row's window and pool live in its draft state
    (:meth:`new_state`), advanced by :meth:`observe` from the target's token after every node."""

    wants_node_outputs = True
    keeps_state = True
    fixed_shape = True  # (W, N, G) fix the tree: the window is kept whole or dropped whole

    def __init__(self, config):
        super().__init__(config)
        self.w, self.n, self.g = config.lookahead_window, config.lookahead_level, config.lookahead_guesses

    def base_budget(self) -> int:
        """The full window and ``G`` candidates of ``N - 1`` tokens."""
        return (self.w - 1) + self.w * (self.n - 2) + self.g * (self.n - 1)

    def new_state(self, prompt: Sequence[int]) -> LookaheadState:
        """A fresh window drawn from ``prompt`` (seeded by its length: the same prompt, the same
        window) and an empty pool."""
        rng = np.random.default_rng(len(prompt))
        return LookaheadState(Window.start(prompt, self.w, self.n, rng), NgramPool(self.n, self.g))

    def draft(self, sources, context, guesses, budget, state: LookaheadState | None = None) -> DraftTree:
        if state is None:
            return DraftTree.single(context[-1])
        root = int(context[-1])
        return build_tree(root, state.window, state.pool.candidates(root)[: self.g], budget,
                          (KIND["lookahead_window"], KIND["lookahead_pool"]))

    def observe(self, state: LookaheadState | None, tree: DraftTree, path: Sequence[int],
                outputs: Sequence[int]) -> None:
        """Advance the row's window with ``outputs`` (the target's token after each node of ``tree``)
        and add its n-grams to the pool; nothing when the step dropped the window."""
        if state is None:
            return
        nodes = locate(tree, state.window)
        if nodes is None:
            return
        grams = state.window.advance(int(tree.tokens[0]), [int(outputs[i]) for i in nodes[-1]])
        for gram in grams:
            state.pool.add(gram)
        state.steps += 1
        state.grams += len(grams)
