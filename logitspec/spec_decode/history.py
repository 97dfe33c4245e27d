"""A draft source over answers this engine has already produced.

Samples of one prompt, and rows of one template, repeat each other: an n-gram source over earlier
answers drafts what they said. :class:`HistorySource` answers ``lookup`` like the other sources of
:mod:`logitspec.spec_decode.ngram_index` (consult it after the row's own context and its reference), newest
answer
first, and keeps at most ``max_tokens`` tokens: the oldest answers are dropped beyond that.
"""
from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Sequence

from logitspec.spec_decode.ngram_index import SequenceIndex, lookup_each


class HistorySource:
    """Finished answers as an n-gram source, bounded to ``max_tokens`` tokens (oldest dropped first)."""

    def __init__(self, max_tokens: int = 100_000, max_ngram: int = 3, min_ngram: int = 1,
                 max_answers: int = 256):
        """``max_answers``: answers a lookup scans at most (newest first), bounding its cost."""
        if max_tokens < 1 or max_answers < 1:
            raise ValueError(f"max_tokens and max_answers must be >= 1, got {max_tokens}, {max_answers}")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_answers = max_answers
        self.answers: deque[SequenceIndex] = deque()
        self.tokens = 0  # tokens held now

    def add(self, answer: Sequence[int]) -> None:
        """Remember one finished answer (the newest); drop the oldest beyond the token budget."""
        answer = list(answer)[-self.max_tokens:]
        if len(answer) <= self.min_ngram:
            return
        self.answers.append(SequenceIndex(answer, self.max_ngram, self.min_ngram))
        self.tokens += len(answer)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self.answers.popleft())

    def lookup(self, key: Sequence[int], max_tokens: int, max_results: int = 1) -> list[list[int]]:
        """Continuations of ``key`` in the newest answers first (distinct first tokens)."""
        return lookup_each(islice(reversed(self.answers), self.max_answers), key, max_tokens, max_results)
