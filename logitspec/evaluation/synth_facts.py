"""Local rows that ask for one planted fact: ``hotpotqa``-style multi-document QA (a made-up fact
sentence planted in the middle of long local text) and ``kv_retrieval`` (a JSON object of random UUIDs)."""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass

from .local_text import sentences
from .longbench import Example
from .synth import Sources, context_budget, make_example
from .synth_passages import fit_passages, pick_passages, pool_size
from .token_count import TokenCounter

__all__ = ["CITIES", "SYLLABLES", "Fact", "make_fact", "plant", "build_hotpotqa", "build_kv_retrieval"]

# Invented names, so a model cannot know the answer without reading the context.
_FIRST = ("Orla", "Tamsin", "Idris", "Bertil", "Yannick", "Maelis", "Corvin", "Ysolde", "Anselm", "Perpetua")
_LAST = (
    "Quellbrook",
    "Dunmarrow",
    "Ashgrove",
    "Feltwick",
    "Ravensmere",
    "Holloway",
    "Tarrant",
    "Winterbourne",
)
# the cities a fact names and the syllables of its made-up codes; make_data_v2 draws wrong choices from them
CITIES = ("Lisbon", "Tromso", "Valparaiso", "Ljubljana", "Marrakesh", "Hobart", "Tallinn", "Cusco", "Bergen")
SYLLABLES = ("ka", "lo", "mi", "ther", "vin", "dra", "sol", "pe", "rix", "an", "to", "bel")
_TEMPLATES = (
    ("{name} was born in the city of {city}.", "In which city was {name} born?", "city"),
    (
        "The {thing} project kept the code name {code} until its end.",
        "What was the code name of the {thing} project?",
        "code",
    ),
    (
        "The lighthouse keeper {name} owned exactly {number} telescopes.",
        "How many telescopes did the lighthouse keeper {name} own?",
        "number",
    ),
)
_THINGS = ("harbour survey", "glass bridge", "night train", "salt archive", "copper bell")
_PASSAGE_TOKENS = 400  # typical passage share; a row has about budget / this passages
_KV_SAMPLE = 8  # pairs counted to estimate a pair's tokens


@dataclass(frozen=True)
class Fact:
    """A sentence to plant, the question it answers, and the answer."""

    sentence: str
    question: str
    answer: str


def make_fact(rng: random.Random) -> Fact:
    """A random made-up fact from a few sentence templates."""
    sentence, question, slot = rng.choice(_TEMPLATES)
    code = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
    values = {
        "name": f"{rng.choice(_FIRST)} {rng.choice(_LAST)}",
        "city": rng.choice(CITIES),
        "thing": rng.choice(_THINGS),
        "code": code,
        "number": str(rng.randint(3, 97)),
    }
    return Fact(sentence.format(**values), question.format(**values), values[slot])


def plant(text: str, sentence: str, rng: random.Random) -> str:
    """``text`` with ``sentence`` inserted between two of its sentences, in the middle half."""
    parts = sentences(text)
    lo, hi = len(parts) // 4, max(len(parts) // 4, (3 * len(parts)) // 4)
    at = rng.randint(lo, hi) if parts else 0
    return " ".join(parts[:at] + [sentence] + parts[at:])


def _hotpot_row(rng: random.Random, tokens: int, counter: TokenCounter, pool) -> Example | None:
    fact = make_fact(rng)
    budget = context_budget("hotpotqa", fact.question, tokens, counter)
    n = max(2, min(len(pool), budget // _PASSAGE_TOKENS))
    chosen = pick_passages(rng, pool, n, budget // n, counter)
    rng.shuffle(chosen)
    headers = [f"Passage {i}:\n{p.title}\n" for i, p in enumerate(chosen, start=1)]
    texts = fit_passages(
        chosen, budget - sum(counter.count_many(headers)) - counter.count(fact.sentence), counter
    )
    middle = rng.randint(n // 3, max(n // 3, (2 * n - 1) // 3))
    texts[middle] = plant(texts[middle], fact.sentence, rng)
    context = "\n".join(h + t for h, t in zip(headers, texts))
    if context.lower().count(fact.answer.lower()) != 1:
        return None  # the answer would not be unique to the planted sentence
    sources = ", ".join(p.source for p in chosen)
    return make_example(
        "hotpotqa",
        context,
        fact.question,
        [fact.answer],
        counter,
        language="en",
        source=f"planted in passage {middle + 1}: {fact.sentence!r}; passages: {sources}",
    )


def build_hotpotqa(
    rng: random.Random, count: int, tokens: int, counter: TokenCounter, sources: Sources
) -> list[Example]:
    """Rows of ``Passage i:\\ntitle\\ntext`` blocks with a made-up fact planted in a middle passage; the
    answer appears nowhere else in the context."""
    pool = sources.passages(pool_size(tokens, tokens // _PASSAGE_TOKENS))
    rows: list[Example] = []
    for _ in range(20 * count):
        if len(rows) == count:
            break
        row = _hotpot_row(rng, tokens, counter, pool)
        if row is not None:
            rows.append(row)
    if len(rows) < count:
        raise ValueError(f"could not plant {count} unique facts in the local passages")
    return rows


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _kv_context(pairs: list[tuple[str, str]]) -> str:
    return json.dumps(dict(pairs), indent=1)


def build_kv_retrieval(
    rng: random.Random, count: int, tokens: int, counter: TokenCounter, sources: Sources
) -> list[Example]:
    """Rows whose context is a JSON object of random UUID keys and values (one pair a line); the input
    is one key, the answer its value."""
    rows = []
    for _ in range(count):
        sample = [(_uuid(rng), _uuid(rng)) for _ in range(_KV_SAMPLE)]
        per_pair = counter.count(_kv_context(sample)) / _KV_SAMPLE
        budget = context_budget("kv_retrieval", sample[0][0], tokens, counter)
        n = max(2, int(budget / per_pair))
        pairs = sample[:n] + [(_uuid(rng), _uuid(rng)) for _ in range(n - len(sample))]
        key, value = pairs[rng.randrange(n)]
        rows.append(
            make_example(
                "kv_retrieval",
                _kv_context(pairs),
                key,
                [value],
                counter,
                language="en",
                source=f"random UUIDs ({n} pairs)",
            )
        )
    return rows
