"""LongBench v2: the multiple-choice format, its prompt, answer extraction and scores as its official
scripts (``pred.py``, ``result.py`` at the LongBench repository's root) compute them.

A LongBench v2 file is the official ``data.json`` (a JSON array) or JSON lines, one object per question
with the keys ``_id, domain, sub_domain, difficulty, length, question, choice_A, choice_B, choice_C,
choice_D, answer, context``. ``difficulty`` is ``easy`` or ``hard``, ``length`` is ``short``, ``medium``
or ``long`` (a category, not a count), ``answer`` one of ``A``-``D``. In a LongBench data directory the
file is ``longbench_v2.json`` / ``longbench_v2.jsonl``, or ``longbench_v2_<part>.json[l]`` for a subset;
:func:`logitspec.evaluation.read_directory` reads it next to v1 files.

As ``pred.py``: the ``0shot`` template filled by plain ``str.replace`` of the stripped fields; a prompt of
more than ``max_len`` tokens keeps ``ids[:max_len//2] + ids[-max_len//2:]``, decoded once; the response
(stripped) is judged by :func:`extract_answer`; a response that is the empty string is not written, so it
is not scored. As ``result.py``: accuracy overall, by difficulty (``easy``, anything else ``hard``) and
by length (``short``, ``medium``, anything else ``long``), ``round(100 * correct / rows, 1)``.
Differences, on purpose: ``pred.py`` samples at temperature 0.1, an evaluation sweep decodes greedily (its
methods must give the same text); a bucket without rows is ``None`` here (``result.py`` divides by zero).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "V2_NAME",
    "V2_KEYS",
    "DIFFICULTIES",
    "LENGTHS",
    "MAX_NEW_TOKENS",
    "TEMPLATES",
    "ExampleV2",
    "is_v2_name",
    "example_v2_from_json",
    "example_v2_to_json",
    "read_v2",
    "write_v2_dataset",
    "format_v2_prompt",
    "truncate_v2",
    "build_v2_prompt",
    "extract_answer",
    "score_v2",
]

V2_NAME = "longbench_v2"
V2_KEYS = ("_id", "domain", "sub_domain", "difficulty", "length", "question",
           "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")
LETTERS = ("A", "B", "C", "D")
DIFFICULTIES = ("easy", "hard")
LENGTHS = ("short", "medium", "long")
MAX_NEW_TOKENS = 128  # pred.py's max_new_tokens without chain of thought

# prompts/0shot.txt and prompts/0shot_no_context.txt of the LongBench repository
TEMPLATES = {
    "0shot": (
        "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
        "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
        "(D) $C_D$\n\nFormat your response as follows: \"The correct answer is (insert answer here)\"."
    ),
    "0shot_no_context": (
        "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n"
        "(D) $C_D$\n\nWhat is the single, most likely answer choice? Format your response as follows: "
        "\"The correct answer is (insert answer here)\"."
    ),
}


@dataclass(frozen=True)
class ExampleV2:
    """One LongBench v2 question. ``name`` is the file's dataset name (``longbench_v2``)."""

    name: str
    id: str
    domain: str
    sub_domain: str
    difficulty: str
    length: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str
    context: str
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def base(self) -> str:
        return V2_NAME


def is_v2_name(name: str) -> bool:
    """``longbench_v2`` or ``longbench_v2_<part>``: a file in the v2 format."""
    return name == V2_NAME or name.startswith(V2_NAME + "_")


def example_v2_from_json(obj: Any, name: str) -> ExampleV2:
    """Check one object against the v2 schema and build its ExampleV2 (ValueError if not)."""
    if not isinstance(obj, dict):
        raise ValueError(f"a question must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in V2_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing keys {missing}")
    for key in V2_KEYS:
        if not isinstance(obj[key], str):
            raise ValueError(f"{key!r} must be a string, got {obj[key]!r:.80}")
    if obj["answer"] not in LETTERS:
        raise ValueError(f"'answer' must be one of A, B, C, D, got {obj['answer']!r:.80}")
    if obj["difficulty"] not in DIFFICULTIES:
        raise ValueError(f"'difficulty' must be 'easy' or 'hard', got {obj['difficulty']!r:.80}")
    if obj["length"] not in LENGTHS:
        raise ValueError(f"'length' must be 'short', 'medium' or 'long', got {obj['length']!r:.80}")
    return ExampleV2(
        name=name, id=obj["_id"], domain=obj["domain"], sub_domain=obj["sub_domain"],
        difficulty=obj["difficulty"], length=obj["length"], question=obj["question"],
        choices=tuple(obj[f"choice_{x}"] for x in LETTERS), answer=obj["answer"], context=obj["context"],
        extra={k: v for k, v in obj.items() if k not in V2_KEYS},
    )


def example_v2_to_json(example: ExampleV2) -> dict[str, Any]:
    """The JSON object of one question, in the official key order, then :attr:`ExampleV2.extra`."""
    obj: dict[str, Any] = {"_id": example.id, "domain": example.domain, "sub_domain": example.sub_domain,
                           "difficulty": example.difficulty, "length": example.length,
                           "question": example.question}
    obj.update({f"choice_{x}": c for x, c in zip(LETTERS, example.choices)})
    obj.update(answer=example.answer, context=example.context)
    obj.update(example.extra)
    return obj


def read_v2(path: str | os.PathLike, name: str = V2_NAME) -> list[ExampleV2]:
    """The questions of a v2 file: a JSON array (the official ``data.json``) or JSON lines.

    ``ValueError`` naming the file (and line or item) for anything malformed.
    """
    path = pathlib.Path(path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON array: {e}") from e
        where = [f"{path}: item {i}" for i in range(len(items))]
    else:
        items, where = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: {e}") from e
            where.append(f"{path}:{number}")
    examples = []
    for obj, at in zip(items, where):
        try:
            examples.append(example_v2_from_json(obj, name))
        except ValueError as e:
            raise ValueError(f"{at}: {e}") from e
    return examples


def write_v2_dataset(directory: str | os.PathLike, name: str, examples: Iterable[ExampleV2]) -> pathlib.Path:
    """Write ``<directory>/<name>.jsonl`` (one question a line, non-ASCII kept); return its path."""
    if not is_v2_name(name):
        raise ValueError(f"a LongBench v2 file is named {V2_NAME} or {V2_NAME}_<part>, not {name!r}")
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    out = path / f"{name}.jsonl"
    with out.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example_v2_to_json(example), ensure_ascii=False) + "\n")
    return out


def format_v2_prompt(example: ExampleV2, template: str = "0shot") -> str:
    """The template filled as ``pred.py`` fills it (``str.replace`` in its order, fields stripped)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown LongBench v2 template {template!r}; known: {', '.join(TEMPLATES)}")
    a, b, c, d = (x.strip() for x in example.choices)
    return (TEMPLATES[template].replace("$DOC$", example.context.strip())
            .replace("$Q$", example.question.strip()).replace("$C_A$", a).replace("$C_B$", b)
            .replace("$C_C$", c).replace("$C_D$", d))


def truncate_v2(prompt: str, tokenizer, max_len: int) -> str:
    """``pred.py``'s cut: more than ``max_len`` tokens (counted with special tokens) keep
    ``ids[:max_len//2] + ids[-max_len//2:]``, decoded in one piece without special tokens."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    ids = list(tokenizer.encode(prompt))
    if len(ids) <= max_len:
        return prompt
    ids = ids[:max_len // 2] + ids[-max_len // 2:]
    return tokenizer.decode(ids, skip_special_tokens=True)


def build_v2_prompt(example: ExampleV2, tokenizer, max_len: int, template: str = "0shot") -> str:
    """:func:`format_v2_prompt` then :func:`truncate_v2` (the text before a chat template)."""
    return truncate_v2(format_v2_prompt(example, template), tokenizer, max_len)


_PAREN = re.compile(r"The correct answer is \(([A-D])\)")
_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """``pred.py``'s ``extract_answer``: ``*`` removed, then "The correct answer is (X)", else
    "The correct answer is X" (first match, A-D); None if neither."""
    response = response.replace("*", "")
    match = _PAREN.search(response) or _BARE.search(response)
    return match.group(1) if match else None


def _acc(correct: int, rows: int) -> float | None:
    return round(100 * correct / rows, 1) if rows else None


def score_v2(examples: Sequence[ExampleV2], responses: Sequence[str | None]) -> dict:
    """``result.py``'s accuracies of ``responses`` (one per example; None: no response).

    Returns ``{"overall", "easy", "hard", "short", "medium", "long"}`` (percent, one decimal; None for
    an empty group), ``"rows"`` (scored), ``"unanswered"`` (responses that are None or empty, which
    ``pred.py`` does not write and ``result.py`` so does not count), ``"no_choice"`` (scored responses
    with no extractable letter, judged wrong) and ``"counts"`` (rows per group).
    """
    examples, responses = list(examples), list(responses)
    if len(examples) != len(responses):
        raise ValueError(f"{len(examples)} questions but {len(responses)} responses")
    groups = ("easy", "hard", "short", "medium", "long")
    rows = {g: 0 for g in groups}
    correct = {g: 0 for g in groups}
    scored = right = unanswered = no_choice = 0
    for e, response in zip(examples, responses):
        if not response:  # pred.py: `if output == '': continue`
            unanswered += 1
            continue
        pred = extract_answer(response.strip())
        no_choice += pred is None
        acc = int(pred == e.answer)
        scored += 1
        right += acc
        level = "easy" if e.difficulty == "easy" else "hard"
        size = e.length if e.length in ("short", "medium") else "long"
        for g in (level, size):
            rows[g] += 1
            correct[g] += acc
    out: dict[str, Any] = {"overall": _acc(right, scored)}
    out.update({g: _acc(correct[g], rows[g]) for g in groups})
    out.update(rows=scored, unanswered=unanswered, no_choice=no_choice, counts=rows)
    return out
