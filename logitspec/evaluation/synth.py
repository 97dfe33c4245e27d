"""Shared steps of the local data builders: sizing text to a token budget and making rows.

Rows carry LongBench's keys plus ``tokens`` (the filled prompt's token count), ``tokens_by`` (how it was
counted) and ``source`` (where the text came from).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .local_text import Passage, corpus_passages, iter_module_passages, sentences, stdlib_modules, stdlib_root
from .longbench import Example
from .prompts import format_prompt
from .token_count import TokenCounter

__all__ = [
    "Sources",
    "row_rng",
    "make_example",
    "longbench_length",
    "context_budget",
    "allocate",
    "trim_to_tokens",
]


@dataclass
class Sources:
    """The local material of one generation run: standard-library files and a text corpus.

    :meth:`passages` is one pool per run: the corpus passages, then module passages in an order fixed
    by ``seed``, parsed only as far as some dataset has needed (parsing them all takes seconds).
    """

    seed: int = 0
    root: pathlib.Path | None = None  # standard-library directory; None: this interpreter's
    corpus_dir: pathlib.Path | None = None
    _modules: list[pathlib.Path] | None = field(default=None, repr=False)
    _pool: list[Passage] = field(default_factory=list, repr=False)
    _unparsed: Iterator[Passage] | None = field(default=None, repr=False)

    def stdlib_dir(self) -> pathlib.Path:
        """The standard-library directory in use."""
        return stdlib_root() if self.root is None else self.root

    def modules(self) -> list[pathlib.Path]:
        """The standard library's module files, sorted (listed once)."""
        if self._modules is None:
            self._modules = stdlib_modules(self.root)
        return self._modules

    def passages(self, count: int) -> list[Passage]:
        """The first ``count`` passages of the pool (fewer if the library has fewer)."""
        if self._unparsed is None:
            order = list(self.modules())
            random.Random(f"logitspec-longbench-local:{self.seed}:modules").shuffle(order)
            self._pool = corpus_passages(self.corpus_dir)
            self._unparsed = iter_module_passages(order, self.root)
        while len(self._pool) < count:
            passage = next(self._unparsed, None)
            if passage is None:
                break
            self._pool.append(passage)
        return self._pool[:count]


def row_rng(seed: int, name: str) -> random.Random:
    """A generator of its own for each dataset, so adding one dataset does not change another's rows."""
    return random.Random(f"logitspec-longbench-local:{seed}:{name}")


def longbench_length(context: str, input: str, answers: Sequence[str]) -> int:
    """LongBench's ``length`` for English and code: whitespace-separated words of input, context, answers."""
    return len(input.split()) + len(context.split()) + sum(len(a.split()) for a in answers)


def make_example(
    name: str,
    context: str,
    input: str,
    answers: Sequence[str],
    counter: TokenCounter,
    *,
    language: str,
    source: str,
    all_classes: Sequence[str] | None = None,
) -> Example:
    """A row with LongBench's fields, an ``_id`` hashed from its content, and the extra fields."""
    digest = hashlib.sha256(json.dumps([name, context, input, list(answers)]).encode("utf-8")).hexdigest()
    return Example(
        name=name,
        input=input,
        context=context,
        answers=tuple(answers),
        all_classes=None if all_classes is None else tuple(all_classes),
        length=longbench_length(context, input, answers),
        dataset=name,
        language=language,
        id=digest[:48],
        extra={
            "tokens": counter.count(format_prompt(name, context, input)),
            "tokens_by": counter.name,
            "source": source,
        },
    )


def context_budget(name: str, input: str, tokens: int, counter: TokenCounter) -> int:
    """Tokens left for the context when the filled prompt should be about ``tokens`` long."""
    budget = tokens - counter.count(format_prompt(name, "", input))
    if budget <= 0:
        raise ValueError(f"{name}: {tokens} tokens do not even hold the prompt template")
    return budget


def allocate(sizes: Sequence[int], budget: int, weights: Sequence[int] | None = None) -> list[int]:
    """Water-filling: give each item up to its size so that ``sum(weight * share) <= budget``, the
    smallest items first, the rest of the budget split evenly among the larger ones."""
    weights = [1] * len(sizes) if weights is None else list(weights)
    shares = [0] * len(sizes)
    remaining, weight_left = budget, sum(weights)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        share = min(sizes[i], max(remaining, 0) // weight_left)
        shares[i] = share
        remaining -= share * weights[i]
        weight_left -= weights[i]
    return shares


def trim_to_tokens(text: str, budget: int, counter: TokenCounter) -> str:
    """The run of whole leading sentences of ``text`` whose length is nearest ``budget`` tokens (a sentence
    is kept while its middle is within the budget, so the cuts of many passages even out); at least one."""
    parts = sentences(text)
    counts = counter.count_many(parts)
    kept, used = [], 0
    for part, n in zip(parts, counts):
        if kept and used + n / 2 > budget:
            break
        kept.append(part)
        used += n + 1  # +1: the joining space
    return " ".join(kept)
