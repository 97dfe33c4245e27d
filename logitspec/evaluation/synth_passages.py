"""Local ``passage_retrieval_en`` and ``passage_count`` rows from standard-library docstrings and the
sample corpus, as ``Paragraph k: ...`` blocks like LongBench's."""

from __future__ import annotations

import difflib
import math
import random
from typing import Sequence

from .local_text import Passage
from .longbench import Example
from .synth import Sources, allocate, context_budget, make_example, trim_to_tokens
from .token_count import TokenCounter

__all__ = [
    "numbered",
    "fit_passages",
    "pool_size",
    "pick_passages",
    "build_passage_retrieval",
    "build_passage_count",
]

RETRIEVAL_PARAGRAPHS = 30  # LongBench's template says "Here are 30 paragraphs"
MAX_COUNT_PARAGRAPHS = 30
_TOKENS_PER_PARAGRAPH = 100  # below this share a row gets fewer paragraphs (small test sets)
_SIMILAR_SUMMARY = 0.6  # distractors whose summary is this close to the abstract would make it ambiguous


def numbered(texts: Sequence[str]) -> str:
    """``Paragraph 1: ...`` blocks separated by blank lines."""
    return "\n\n".join(f"Paragraph {i}: {text}" for i, text in enumerate(texts, start=1))


def fit_passages(
    passages: Sequence[Passage], budget: int, counter: TokenCounter, weights: Sequence[int] | None = None
) -> list[str]:
    """Each passage's text cut to whole sentences so that all of them (each ``weights[i]`` times) take
    about ``budget`` tokens; short passages stay whole and leave their share to the long ones."""
    sizes = counter.count_many([p.text for p in passages])
    shares = allocate(sizes, budget, weights)
    return [
        p.text if share >= size else trim_to_tokens(p.text, share, counter)
        for p, size, share in zip(passages, sizes, shares)
    ]


def pool_size(tokens: int, paragraphs: int) -> int:
    """How many passages to draw from: enough for the paragraphs and, at long targets, for long ones."""
    return max(paragraphs + 10, tokens // 40)


def pick_passages(
    rng: random.Random, candidates: Sequence[Passage], n: int, share: int, counter: TokenCounter
) -> list[Passage]:
    """``n`` passages at random, those of at least ``share`` tokens first, so a row reaches its length."""
    sizes = counter.count_many([p.text for p in candidates])
    long = [p for p, size in zip(candidates, sizes) if size >= share]
    if len(long) >= n:
        return rng.sample(long, n)
    short = [p for p, size in zip(candidates, sizes) if size < share]
    return long + rng.sample(short, min(len(short), n - len(long)))


def _paragraph_budget(
    name: str, input: str, tokens: int, counter: TokenCounter, most: int
) -> tuple[int, int]:
    """(number of paragraphs, tokens for their texts) for a row of about ``tokens`` tokens."""
    budget = context_budget(name, input, tokens, counter)
    n = max(3, min(most, budget // _TOKENS_PER_PARAGRAPH))
    return n, budget - counter.count(numbered([""] * n))


def _similar(a: str | None, b: str) -> bool:
    return a is not None and difflib.SequenceMatcher(None, a, b).ratio() >= _SIMILAR_SUMMARY


def build_passage_retrieval(
    rng: random.Random, count: int, tokens: int, counter: TokenCounter, sources: Sources
) -> list[Example]:
    """Rows whose input is a module docstring's summary (its first paragraph) and whose context holds
    that module's other docstring prose among others; the answer is ``Paragraph k``."""
    pool = sources.passages(pool_size(tokens, RETRIEVAL_PARAGRAPHS + count))
    targets = [p for p in pool if p.summary is not None]
    if len(targets) < count:
        raise ValueError(f"only {len(targets)} standard-library modules with a summary; asked {count} rows")
    rows = []
    for target in rng.sample(targets, count):
        n, budget = _paragraph_budget(
            "passage_retrieval_en", target.summary, tokens, counter, RETRIEVAL_PARAGRAPHS
        )
        others = [p for p in pool if p is not target and not _similar(p.summary, target.summary)]
        if len(others) < n - 1:
            raise ValueError(f"only {len(others)} distractor passages for {n} paragraphs")
        chosen = pick_passages(rng, others, n - 1, budget // n, counter)
        rng.shuffle(chosen)
        k = rng.randrange(n)
        chosen.insert(k, target)
        rows.append(
            make_example(
                "passage_retrieval_en",
                numbered(fit_passages(chosen, budget, counter)),
                target.summary,
                [f"Paragraph {k + 1}"],
                counter,
                language="en",
                source=f"{target.source} summary; paragraphs: " + ", ".join(p.source for p in chosen),
            )
        )
    return rows


def build_passage_count(
    rng: random.Random, count: int, tokens: int, counter: TokenCounter, sources: Sources
) -> list[Example]:
    """Rows of ``n`` paragraphs, ``u`` of them unique and the rest exact repeats, shuffled; answer ``u``."""
    pool = sources.passages(pool_size(tokens, MAX_COUNT_PARAGRAPHS))
    rows = []
    for _ in range(count):
        n, budget = _paragraph_budget("passage_count", "", tokens, counter, MAX_COUNT_PARAGRAPHS)
        unique = rng.randint(max(2, math.ceil(n / 3)), n - 1)
        picked = pick_passages(rng, pool, unique, budget // n, counter)
        rng.shuffle(picked)
        slots = list(range(unique)) + [rng.randrange(unique) for _ in range(n - unique)]
        rng.shuffle(slots)
        texts = fit_passages(picked, budget, counter, weights=[slots.count(i) for i in range(unique)])
        if len(set(texts)) != unique:
            raise ValueError(
                "two different passages were cut to the same text"
            )  # not seen; guards the answer
        rows.append(
            make_example(
                "passage_count",
                numbered([texts[i] for i in slots]),
                "",
                [str(unique)],
                counter,
                language="en",
                source="paragraphs: " + ", ".join(p.source for p in picked),
            )
        )
    return rows
