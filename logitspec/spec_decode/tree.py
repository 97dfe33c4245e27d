"""Draft trees as ``(tokens, parents)``; depth, mask, positions and paths are derived."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GUESS = -1  # origin of a node guessed from the last logits (DraftTree.origins)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in topological order: node 0 is the root, ``parents[i] < i`` for i > 0.

    tokens:  int64 [n]  token id of each node
    parents: int64 [n]  parent node index, -1 for the root
    """

    tokens: np.ndarray
    parents: np.ndarray
    retrieved: bool = False  # whether retrieval (not only logit guesses) supplied a draft token
    # where each node came from (for acceptance statistics): branch kind and index within its chain
    kinds: np.ndarray | None = None  # int64 [n]; 0 for the root
    offsets: np.ndarray | None = None  # int64 [n]; 0 for the first token of a chain
    # which draft source supplied each node: its position in the row's sources, or GUESS (a token
    # guessed from the last logits; also the root's value)
    origins: np.ndarray | None = None  # int64 [n]
    _children: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if n != len(self.parents) or n == 0:
            raise ValueError("tokens and parents must be non-empty and of equal length")
        later = self.parents[1:]
        if self.parents[0] != -1 or n > 1 and not ((later >= 0) & (later < np.arange(1, n))).all():
            raise ValueError(f"parents must be topological with root 0: {self.parents.tolist()}")

    @classmethod
    def single(cls, root_token: int) -> "DraftTree":
        return cls(np.array([root_token], dtype=np.int64), np.array([-1], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, node: int, token: int) -> int | None:
        """Index of ``node``'s child carrying ``token``, or None."""
        if self._children is None:  # built on first use: most trees are never walked by token
            children = {}
            for i, (p, t) in enumerate(zip(self.parents[1:].tolist(), self.tokens[1:].tolist()), 1):
                children.setdefault((p, t), i)
            object.__setattr__(self, "_children", children)
        return self._children.get((node, token))

    @property
    def depths(self) -> np.ndarray:
        """int64 [n]: root depth 0."""
        d = np.zeros(len(self), dtype=np.int64)
        for i in range(1, len(self)):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """bool [n, n]: ``m[i, j]`` is True when j is i or an ancestor of i (what node i may attend to)."""
        n = len(self)
        m = np.zeros((n, n), dtype=bool)
        for i in range(n):
            if i:
                m[i] = m[self.parents[i]]
            m[i, i] = True
        return m

    def origin_name(self, node: int, source_names: list[str]) -> str:
        """Which draft source supplied ``node``: one of ``source_names`` (a row's sources, in order),
        or "guess" (the logits)."""
        origin = GUESS if self.origins is None else int(self.origins[node])
        return "guess" if origin == GUESS else source_names[origin]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def subtree(self, keep) -> "DraftTree":
        """The tree restricted to the ancestor-closed node set ``keep`` (root included)."""
        keep = sorted(set(int(k) for k in keep) | {0})
        new = {old: i for i, old in enumerate(keep)}
        parents = [-1] + [new[int(self.parents[k])] for k in keep[1:]]  # KeyError: not ancestor-closed
        def pick(a):
            return None if a is None else a[keep]
        return DraftTree(self.tokens[keep], np.asarray(parents, dtype=np.int64), self.retrieved,
                         pick(self.kinds), pick(self.offsets), pick(self.origins))


class TreeBuilder:
    """Builds a :class:`DraftTree` by inserting token chains into a trie under a fixed node budget.

    Shared prefixes are merged, so no token is verified twice; ``capacity`` counts draft nodes
    (the root excluded).
    """

    def __init__(self, root_token: int, capacity: int):
        self.tokens = [int(root_token)]
        self.parents = [-1]
        self.children: list[dict[int, int]] = [{}]
        self.capacity = capacity
        self.retrieved = False
        self.kinds = [0]
        self.offsets = [0]
        self.origins = [GUESS]

    @property
    def full(self) -> bool:
        return len(self.tokens) - 1 >= self.capacity

    def add_chain(self, chain, parent: int = 0, kind: int = 1, origin: int = 0,
                  first_origin: int | None = None) -> int:
        """Insert ``chain`` below ``parent``; returns the number of new nodes (stops at capacity).
        New nodes are tagged with ``kind``, their offset in the chain and ``origin`` (the chain's
        first token with ``first_origin`` when given, e.g. a logit guess continued by retrieval)."""
        added = 0
        node = parent
        for off, tok in enumerate(chain):
            tok = int(tok)
            nxt = self.children[node].get(tok)
            if nxt is None:
                if self.full:
                    break
                nxt = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(node)
                self.children.append({})
                self.children[node][tok] = nxt
                self.kinds.append(kind)
                self.offsets.append(off)
                self.origins.append(first_origin if off == 0 and first_origin is not None else origin)
                added += 1
            node = nxt
        return added

    def build(self) -> DraftTree:
        return DraftTree(
            np.asarray(self.tokens, dtype=np.int64),
            np.asarray(self.parents, dtype=np.int64),
            retrieved=self.retrieved,
            kinds=np.asarray(self.kinds, dtype=np.int64),
            offsets=np.asarray(self.offsets, dtype=np.int64),
            origins=np.asarray(self.origins, dtype=np.int64),
        )
