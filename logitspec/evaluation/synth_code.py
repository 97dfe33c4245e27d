"""Local ``lcc`` rows: the first part of a long standard-library module, answer the true next line."""

from __future__ import annotations

import io
import pathlib
import random
import tokenize

from .longbench import Example
from .metrics import first_code_line
from .synth import Sources, context_budget, make_example
from .token_count import CHARS_PER_TOKEN, TokenCounter

__all__ = ["string_rows", "is_answer_line", "build_lcc"]

_MIN_ANSWER_CHARS = 4
# standard-library folders of generated tables and text data rather than code
_NOT_CODE = frozenset({"encodings", "pydoc_data"})


def string_rows(source: str) -> set[int]:
    """1-based rows covered by string literals that span several lines (docstrings and the like)."""
    rows: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.start[0] != tok.end[0] and tok.type not in (tokenize.NEWLINE, tokenize.NL):
                rows.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass  # rows after the error stay unmarked; the file parsed as far as it goes
    return rows


def is_answer_line(line: str) -> bool:
    """A line LongBench's code metric can match whole: code, not blank, no comment or backtick."""
    line = line.rstrip()
    return len(line.strip()) >= _MIN_ANSWER_CHARS and first_code_line(line) == line


def _row(path: pathlib.Path, budget: int, counter: TokenCounter, label: str) -> Example | None:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    # count only what can fit: a token is rarely under 2 characters of code
    limit, chars = 0, 0
    while limit < len(lines) and chars < budget * CHARS_PER_TOKEN * 2:
        chars += len(lines[limit])
        limit += 1
    counts = counter.count_many(lines[:limit])
    cut, used = 0, 0
    while cut < len(counts) and used + counts[cut] <= budget:
        used += counts[cut]
        cut += 1
    if cut >= len(lines) - 1:
        return None  # the module is shorter than the budget
    # the answer is the last code line that still fits, so the prompt stays within the budget
    in_string = string_rows(source)
    while cut > 0 and (cut + 1 in in_string or not is_answer_line(lines[cut])):
        cut -= 1
    if cut == 0:
        return None
    source = f"stdlib:{label} (first {cut} lines; answer: line {cut + 1})"
    answer = lines[cut].rstrip()
    return make_example("lcc", "".join(lines[:cut]), "", [answer], counter, language="python", source=source)


def build_lcc(
    rng: random.Random, count: int, tokens: int, counter: TokenCounter, sources: Sources
) -> list[Example]:
    """``count`` rows whose filled prompt is about ``tokens`` long (cut 0-5% short at random so rows
    from one module differ), from modules long enough for it, cycling through them if needed."""
    budget = context_budget("lcc", "", tokens, counter)
    root = sources.stdlib_dir()
    long_enough = [
        p
        for p in sources.modules()
        if p.stat().st_size > budget * CHARS_PER_TOKEN * 1.2
        and not _NOT_CODE & set(p.relative_to(root).parts)
    ]
    if not long_enough:
        raise ValueError(f"no standard-library module is long enough for {tokens} tokens of code")
    rng.shuffle(long_enough)
    rows: list[Example] = []
    attempts = 0
    while len(rows) < count and attempts < 4 * count + len(long_enough):
        path = long_enough[attempts % len(long_enough)]
        attempts += 1
        row = _row(path, int(budget * rng.uniform(0.95, 1.0)), counter, _label(path, root))
        if row is not None and all(row.id != r.id for r in rows):
            rows.append(row)
    if len(rows) < count:
        raise ValueError(f"only {len(rows)} distinct lcc rows of {tokens} tokens from the standard library")
    return rows


def _label(path: pathlib.Path, root: pathlib.Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name
