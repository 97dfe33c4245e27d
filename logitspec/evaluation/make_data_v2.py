"""Make a small LongBench v2 (multiple-choice) sample from a local LongBench v1 set.

    python -m logitspec.evaluation.make_data_v2 --src data/longbench_local --out data/longbench_v2_local

Each v1 row of ``kv_retrieval``, ``passage_retrieval_en``, ``passage_count``, ``hotpotqa`` and ``lcc``
becomes one question in the v2 format (``longbench_v2.jsonl``): the same context, the question asked in
words, its answer among four choices whose three wrong ones come from the same row (other values of the
JSON object, other paragraph numbers, nearby counts, other lines of the code) or, for the planted facts,
from the generator's own name lists. The letter of the right choice is drawn per row with a seeded
generator. Standard library only; the same source files and seed give the same file on any Python.

``difficulty``: ``easy`` for a lookup (kv_retrieval, passage_retrieval_en, hotpotqa), ``hard`` for
counting and code (passage_count, lcc). ``length``: LongBench v2's category of the context's words
(``short`` below 32,000 words, ``medium`` below 128,000, ``long`` above), so rows of a few thousand
tokens are all ``short``. Each row keeps ``source_dataset``, ``source_id`` and ``source_answer`` (the
v1 answer, the text of the right choice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random
import re
import sys
from typing import Callable, Sequence

from .longbench import Example, read_directory
from .longbench_v2 import LETTERS, V2_NAME, ExampleV2, write_v2_dataset
from .synth_facts import CITIES, SYLLABLES

__all__ = ["SOURCES", "length_category", "convert", "generate", "main"]

SHORT_WORDS, MEDIUM_WORDS = 32_000, 128_000  # LongBench v2's length categories, in words


def length_category(text: str) -> str:
    words = len(text.split())
    return "short" if words < SHORT_WORDS else "medium" if words < MEDIUM_WORDS else "long"


def _kv(e: Example, rng: random.Random) -> tuple[str, list[str]]:
    values = [v for k, v in json.loads(e.context).items() if k != e.input and v != e.answers[0]]
    return (f'In the JSON object, which value belongs to the key "{e.input}"?', rng.sample(values, 3))


def _retrieval(e: Example, rng: random.Random) -> tuple[str, list[str]]:
    found = {f"Paragraph {n}" for n in re.findall(r"^Paragraph (\d+):", e.context, re.M)}
    labels = sorted(found - {e.answers[0]})
    return (f'Which paragraph is this abstract from: "{e.input}"?', rng.sample(labels, 3))


def _count(e: Example, rng: random.Random) -> tuple[str, list[str]]:
    n = int(e.answers[0])
    near = [str(k) for k in (n - 2, n - 1, n + 1, n + 2, n + 3) if k > 0]
    return ("Some of the paragraphs above repeat others word for word. "
            "How many different paragraphs are there?", rng.sample(near, 3))


def _fact(e: Example, rng: random.Random) -> tuple[str, list[str]]:
    answer = e.answers[0]
    if answer.isdigit():
        pool = sorted({str(k) for k in range(3, 98)} - {answer})
    elif answer in CITIES:
        pool = sorted(set(CITIES) - {answer})
    else:  # a made-up code name of three syllables
        codes = {"".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize() for _ in range(40)}
        pool = sorted(codes - {answer})
    return e.input, rng.sample(pool, 3)


def _next_line(e: Example, rng: random.Random) -> tuple[str, list[str]]:
    answer = e.answers[0]
    lines = {ln.strip() for ln in e.context.splitlines()[-300:]}  # stripped, as pred.py shows choices
    lines -= {"", answer.strip()}
    lines = sorted(ln for ln in lines if not ln.startswith(("#", '"', "'")))
    return "Which line comes next after the end of the code above?", rng.sample(lines, 3)


Maker = Callable[[Example, random.Random], "tuple[str, list[str]]"]
SOURCES: dict[str, tuple[Maker, str, str, str]] = {  # dataset: (maker, domain, sub_domain, difficulty)
    "kv_retrieval": (_kv, "Long Structured Data Understanding", "Key-value lookup", "easy"),
    "passage_retrieval_en": (_retrieval, "Multi-Document QA", "Passage retrieval", "easy"),
    "passage_count": (_count, "Multi-Document QA", "Passage count", "hard"),
    "hotpotqa": (_fact, "Multi-Document QA", "Planted fact", "easy"),
    "lcc": (_next_line, "Code Repository Understanding", "Next line", "hard"),
}


def convert(e: Example, seed: int = 0) -> ExampleV2:
    """One v1 row as a v2 question (its source dataset must be in :data:`SOURCES`)."""
    maker, domain, sub_domain, difficulty = SOURCES[e.name]
    rng = random.Random(f"{seed}:{e.name}:{e.id}")
    question, wrong = maker(e, rng)
    right = e.answers[0].strip()  # pred.py shows every choice stripped
    slot = rng.randrange(4)
    choices = wrong[:slot] + [right] + wrong[slot:]
    if len({c.strip() for c in choices}) != 4:
        raise ValueError(f"{e.name}/{e.id}: choices are not distinct: {choices}")
    return ExampleV2(
        name=V2_NAME, id=hashlib.sha256(f"v2:{e.name}:{e.id}".encode()).hexdigest()[:48], domain=domain,
        sub_domain=sub_domain, difficulty=difficulty, length=length_category(e.context), question=question,
        choices=tuple(choices), answer=LETTERS[slot], context=e.context,
        extra={"source_dataset": e.name, "source_id": e.id, "source_answer": e.answers[0]},
    )


def generate(src: pathlib.Path, out: pathlib.Path, seed: int = 0,
             datasets: Sequence[str] = tuple(SOURCES)) -> list[ExampleV2]:
    """Convert the rows of ``datasets`` in ``src`` and write ``out/longbench_v2.jsonl``; return them."""
    data = read_directory(src, list(datasets))
    rows = [convert(e, seed) for name in datasets for e in data[name]]
    write_v2_dataset(out, V2_NAME, rows)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m logitspec.evaluation.make_data_v2",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=pathlib.Path, default=pathlib.Path("data/longbench_local"),
                   help="a local LongBench v1 directory (default data/longbench_local)")
    p.add_argument("--out", type=pathlib.Path, required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        rows = generate(args.src, args.out, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out / (V2_NAME + '.jsonl')}: {len(rows)} questions, answers "
          + ", ".join(f"{x} {sum(r.answer == x for r in rows)}" for x in LETTERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
