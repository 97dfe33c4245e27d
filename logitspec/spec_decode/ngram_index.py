"""N-gram indexes: continuations of an n-gram seen earlier in a token stream.

``SequenceIndex`` grows with one sequence (prompt + generated tokens). ``CorpusIndex`` is built once
from a reference corpus, stored as numpy arrays (shareable zero-copy through Ray's object store), and
never changes. Both answer ``lookup(key, max_tokens, max_results)``.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import numpy as np


class NgramSource(Protocol):
    max_ngram: int

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        """Up to ``max_results`` distinct non-empty continuations of ``key``, best first."""


class SequenceIndex:
    """Incremental index of one sequence: n-gram (n = min..max) -> end positions, oldest first."""

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks = self.tokens
        for t in new_tokens:
            toks.append(int(t))
            end = len(toks) - 1
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._ends.setdefault(tuple(toks[end - n + 1 :]), []).append(end)

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        """Continuations after the most recent occurrences of ``key`` (distinct first tokens)."""
        ends = self._ends.get(tuple(key))
        if not ends or max_tokens <= 0:
            return []
        out: list[list[int]] = []
        firsts = set()
        toks = self.tokens
        for end in reversed(ends):
            cont = toks[end + 1 : end + 1 + max_tokens]
            if not cont or cont[0] in firsts:
                continue
            firsts.add(cont[0])
            out.append(cont)
            if len(out) >= max_results:
                break
        return out


class CorpusIndex:
    """Immutable n-gram index over a token corpus, as numpy arrays.

    For each n, the corpus positions are sorted by the n-gram that ends there (``keys[n]``: uint64
    hashes, ``pos[n]``: int64 end positions), so a lookup is one ``searchsorted``.
    """

    def __init__(self, tokens: np.ndarray, keys: dict[int, np.ndarray], pos: dict[int, np.ndarray]):
        self.tokens = tokens
        self.keys = keys
        self.pos = pos
        self.max_ngram = max(keys) if keys else 0

    @staticmethod
    def _hash(windows: np.ndarray) -> np.ndarray:
        """uint64 [m] hash of each row of int64 [m, n] token windows (exact for n <= 2, vocab < 2**31)."""
        h = np.zeros(windows.shape[0], dtype=np.uint64)
        for j in range(windows.shape[1]):
            h = h * np.uint64(0x100000001B3) ^ windows[:, j].astype(np.uint64)
        return h

    @classmethod
    def build(cls, docs: Sequence[Sequence[int]], max_ngram: int = 3, min_ngram: int = 1) -> "CorpusIndex":
        """Index documents; a separator (-1) keeps n-grams from spanning two documents."""
        parts = []
        for d in docs:
            parts.append(np.asarray(d, dtype=np.int64))
            parts.append(np.array([-1], dtype=np.int64))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        keys, pos = {}, {}
        for n in range(min_ngram, max_ngram + 1):
            if len(tokens) < n + 1:
                continue
            # [m, n]; drop last (no continuation)
            win = np.lib.stride_tricks.sliding_window_view(tokens, n)[:-1]
            ends = np.arange(n - 1, n - 1 + len(win), dtype=np.int64)
            ok = (win >= 0).all(axis=1) & (tokens[ends + 1] >= 0)
            h = cls._hash(win[ok])
            order = np.argsort(h, kind="stable")
            keys[n], pos[n] = h[order], ends[ok][order]
        return cls(tokens, keys, pos)

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        n = len(key)
        if n not in self.keys or max_tokens <= 0:
            return []
        h = self._hash(np.asarray(key, dtype=np.int64)[None, :])[0]
        lo = np.searchsorted(self.keys[n], h, side="left")
        hi = np.searchsorted(self.keys[n], h, side="right")
        out, firsts = [], set()
        for end in self.pos[n][lo:hi][:64]:  # bounded work per lookup
            if not np.array_equal(self.tokens[end - n + 1 : end + 1], key):
                continue  # hash collision
            cont = self.tokens[end + 1 : end + 1 + max_tokens]
            stop = np.flatnonzero(cont < 0)
            cont = cont[: stop[0]] if len(stop) else cont
            if len(cont) == 0 or int(cont[0]) in firsts:
                continue
            firsts.add(int(cont[0]))
            out.append(cont.tolist())
            if len(out) >= max_results:
                break
        return out

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Flat dict of arrays (for ``np.savez`` or the object store)."""
        d = {"tokens": self.tokens}
        for n in self.keys:
            d[f"keys{n}"], d[f"pos{n}"] = self.keys[n], self.pos[n]
        return d

    @classmethod
    def from_arrays(cls, arrays) -> "CorpusIndex":
        keys = {int(k[4:]): arrays[k] for k in arrays if k.startswith("keys")}
        pos = {int(k[3:]): arrays[k] for k in arrays if k.startswith("pos")}
        return cls(arrays["tokens"], keys, pos)


class SiblingSource:
    """The answers so far of the other samples of one prompt, as one draft source: ``group`` is a
    list every sample's :class:`SequenceIndex` is appended to when it starts (shared by the samples,
    so each sees the siblings started after it too), ``own`` the sample's own index (skipped).
    Samples of one prompt repeat each other's phrasing even when sampled; the shared prompt is the
    row's own context already, so matches there are found first in ``own``."""

    def __init__(self, group: list[SequenceIndex], own: SequenceIndex):
        self.group, self.own = group, own
        self.max_ngram = own.max_ngram

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        """Up to ``max_results`` continuations with distinct first tokens, siblings in start order."""
        return lookup_each((idx for idx in self.group if idx is not self.own), key, max_tokens, max_results)


def lookup_each(sources: Iterable[NgramSource], key: Sequence[int], max_tokens: int,
                max_results: int = 1) -> list[list[int]]:
    """Up to ``max_results`` continuations of ``key`` with distinct first tokens, from ``sources``
    in order (each asked only while results are missing)."""
    out: list[list[int]] = []
    firsts: set[int] = set()
    for src in sources:
        for cont in src.lookup(key, max_tokens, max_results):
            if cont[0] not in firsts:
                firsts.add(cont[0])
                out.append(cont)
                if len(out) >= max_results:
                    return out
    return out


def retrieve(sources: Sequence[NgramSource], context: Sequence[int], max_tokens: int,
             max_results: int = 1, max_ngram: int = 3, min_ngram: int = 1) -> list[list[int]]:
    """Continuations of the longest suffix of ``context`` found, trying each source in order per n."""
    return retrieve_with_order(sources, context, max_tokens, max_results, max_ngram, min_ngram)[0]


def retrieve_with_order(sources: Sequence[NgramSource], context: Sequence[int], max_tokens: int,
                        max_results: int = 1, max_ngram: int = 3,
                        min_ngram: int = 1) -> tuple[list[list[int]], int, int]:
    """Like :func:`retrieve`, plus the length n of the matched suffix (0 when nothing matched) and
    the position in ``sources`` of the source that matched (-1 when none)."""
    for n in range(min(max_ngram, len(context)), min_ngram - 1, -1):
        key = context[len(context) - n :]
        for i, src in enumerate(sources):
            hits = src.lookup(key, max_tokens, max_results)
            if hits:
                return hits, n, i
    return [], 0, -1
