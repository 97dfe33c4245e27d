"""Prefilled KV rows kept by prompt token ids, so a prompt seen before is not prefilled again.

One :class:`PrefixCache` may be shared by several engines over the same model (an evaluation sweep
prefills each row once for all its methods): pass it as ``Engine(..., prefix_cache=cache)``. An
exact prompt match gives back the row and the last prompt token's output (the first new token is
picked from it); otherwise the longest cached prefix that ends on a multiple of ``block`` tokens
(and before the prompt's last token) is copied and only the rest is prefilled. The KV of a
prefix does not depend on what follows it (causal attention), so reuse is exact. Entries are
evicted least recently used first, to stay within ``max_bytes``.
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from logitspec.worker.kv_cache import BatchKV


@dataclass
class _Entry:
    row: BatchKV  # one compact row: the prompt's KV
    last: Any  # the last prompt token's output-layer result ([1, V] NodeLogits)
    nbytes: int
    prefixes: list[bytes]  # digests of the prompt's prefixes at block multiples


@dataclass
class PrefixHit:
    """What a lookup found: ``row`` holds the first ``tokens`` prompt tokens' KV (a private copy);
    ``last`` is the last prompt token's output when the whole prompt matched, else None."""

    row: BatchKV
    tokens: int
    last: Any = None


class PrefixCache:
    """Bounded LRU store of prefilled prompt rows, keyed by token ids and the kind of output kept."""

    def __init__(self, max_bytes: int, block: int = 512):
        """``max_bytes``: the KV (and last-output) bytes held at most; ``block``: prefixes are
        matched at multiples of this many tokens (a multiple of the engines' ``prefill_chunk``
        keeps the resumed prefill's chunks where a fresh prefill puts them)."""
        if max_bytes < 0 or block < 1:
            raise ValueError(f"PrefixCache needs max_bytes >= 0 and block >= 1, got {max_bytes}, {block}")
        self.max_bytes = max_bytes
        self.block = block
        self.nbytes = 0
        self.hits = self.partial_hits = self.misses = 0
        self.lookup_tokens = self.hit_tokens = 0
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._by_prefix: dict[bytes, tuple] = {}  # prefix digest -> key of an entry that has it
        self._model: weakref.ref | None = None
        self._lock = threading.Lock()

    def bind(self, model) -> None:
        """Tie the cache to ``model`` (an engine does this); ValueError for a different model."""
        with self._lock:
            if self._model is not None and self._model() is not model and self._model() is not None:
                raise ValueError("this PrefixCache holds another model's KV; share it only between engines "
                                 "over the same model object")
            self._model = weakref.ref(model)

    def _digests(self, ids: list[int], kind: int, upto: int) -> list[bytes]:
        """Digests of ``ids[:k * block]`` for k = 1 .. (largest with k * block <= ``upto``)."""
        h = hashlib.blake2b(bytes([kind]), digest_size=16)
        out = []
        arr = np.asarray(ids, dtype=np.int64)
        for end in range(self.block, upto + 1, self.block):
            h.update(arr[end - self.block:end].tobytes())
            out.append(h.copy().digest())
        return out

    def lookup(self, ids: list[int], kind: int) -> PrefixHit | None:
        """The cached KV of ``ids`` (whole prompt) or of its longest cached block prefix, or None;
        ``kind`` tells apart outputs kept for different uses (the session's head flags)."""
        key = (kind, tuple(ids))
        with self._lock:
            self.lookup_tokens += len(ids)
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                self.hit_tokens += len(ids)
                return PrefixHit(entry.row.row_prefix(0, len(ids)), len(ids), entry.last)
            digests = self._digests(ids, kind, len(ids) - 1)
            for k in range(len(digests) - 1, -1, -1):
                owner = self._by_prefix.get(digests[k])
                if owner is not None and owner in self._entries:
                    self._entries.move_to_end(owner)
                    n = (k + 1) * self.block
                    self.partial_hits += 1
                    self.hit_tokens += n
                    return PrefixHit(self._entries[owner].row.row_prefix(0, n), n)
            self.misses += 1
            return None

    def store(self, ids: list[int], kind: int, row: BatchKV, last: Any, index: int = 0) -> None:
        """Keep a compact copy of row ``index`` of ``row`` (holding ``ids``) and ``last``."""
        key = (kind, tuple(ids))
        nbytes = len(ids) * row.column_bytes + sum(t.nbytes for t in vars(last).values()
                                                   if isinstance(t, torch.Tensor))
        if key in self._entries or nbytes > self.max_bytes:  # checked before copying anything
            return
        copy = row.row_prefix(index, len(ids))
        with self._lock:
            if key in self._entries:
                return
            prefixes = self._digests(ids, kind, len(ids))
            self._entries[key] = _Entry(copy, last, nbytes, prefixes)
            self.nbytes += nbytes
            for d in prefixes:
                self._by_prefix[d] = key
            while self.nbytes > self.max_bytes:
                self._evict()

    def _evict(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        for d in entry.prefixes:
            if self._by_prefix.get(d) == key:
                del self._by_prefix[d]

    @property
    def stats(self) -> dict[str, float]:
        """Lookups that found the whole prompt (``hits``) or a block prefix (``partial_hits``), ``misses``,
        ``hit_rate`` (either kind per lookup), ``token_hit_rate`` (prompt tokens not prefilled),
        entries and bytes held."""
        lookups = self.hits + self.partial_hits + self.misses
        return {"hits": self.hits, "partial_hits": self.partial_hits, "misses": self.misses,
                "hit_rate": (self.hits + self.partial_hits) / lookups if lookups else 0.0,
                "token_hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
                "entries": len(self._entries), "bytes": self.nbytes}
