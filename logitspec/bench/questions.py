"""Spec-Bench questions: the one loader of ``question.jsonl`` rows, the task list, and turn prompts.

Spec-Bench's 480 rows form 6 tasks; its 8 MT-bench categories count as one task (``mt_bench``).
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

# Spec-Bench's task order; the eight MT-bench categories form one task.
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities")
# data, not code: Spec-Bench's file beside the repository (a clear error when it is missing)
DEFAULT_QUESTIONS = (pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench"
                     / "question.jsonl")


@dataclass(frozen=True)
class Question:
    """One Spec-Bench row; ``turns`` are texts, or token-id lists for a model without a tokenizer.
    ``max_new_tokens``: the question's own answer length (a LongBench data set's), None: the run's."""

    question_id: Any
    category: str
    turns: tuple
    max_new_tokens: int | None = None

    @property
    def task(self) -> str:
        return "mt_bench" if self.category in MT_BENCH_CATEGORIES else self.category


def load_questions(path=None, per_task: int | None = None,
                   categories: Sequence[str] | None = None) -> list[Question]:
    """Rows of a Spec-Bench ``question.jsonl``, in file order, grouped by task (Spec-Bench's order).
    A job's JSONL input (``{"id", "prompt", "task"?}`` rows, e.g. ``data/demo/prompts.jsonl``) reads
    as one-turn questions of its ``task`` column (``prompts`` without one).

    ``categories`` keeps rows whose category or task is listed; ``per_task`` then keeps the first N
    rows of each task.
    """
    path = pathlib.Path(path) if path is not None else DEFAULT_QUESTIONS
    if not path.is_file():
        raise ValueError(f"questions file not found: {path} (Spec-Bench's question.jsonl; the default is "
                         f"../shared/data/spec_bench/question.jsonl beside the repository; pass --questions)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if "turns" not in d and isinstance(d.get("prompt"), str):  # a job's input row
                    rows.append(Question(d["id"], str(d.get("task") or "prompts"), (d["prompt"],)))
                    continue
                turns = tuple(t if isinstance(t, str) else tuple(int(x) for x in t) for t in d["turns"])
                rows.append(Question(d["question_id"], str(d["category"]), turns))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: neither a Spec-Bench row nor a job's prompt row ({e})"
                                 ) from None
            if not rows[-1].turns:
                raise ValueError(f"{path}:{n}: no turns")
    return select_questions(rows, per_task, categories)


def select_questions(rows: Sequence[Question], per_task: int | None = None,
                     categories: Sequence[str] | None = None) -> list[Question]:
    if categories:
        wanted = set(categories)
        known = {q.category for q in rows} | {q.task for q in rows}
        if wanted - known:
            raise ValueError(f"unknown categories {sorted(wanted - known)}; known: {sorted(known)}")
        rows = [q for q in rows if q.category in wanted or q.task in wanted]
    if per_task is not None and per_task < 1:
        raise ValueError(f"per_task must be >= 1, got {per_task}")
    out = []
    for t in task_order(q.task for q in rows):
        out += [q for q in rows if q.task == t][:per_task]
    if not out:
        raise ValueError("no questions selected")
    return out


def task_order(tasks: Iterable[str]) -> list[str]:
    """The distinct ``tasks``: Spec-Bench's in its order, then any other in name order."""
    present = set(tasks)
    return [t for t in TASKS if t in present] + sorted(present - set(TASKS))


def first_turns(path=None, per_task: int | None = None, max_chars: int | None = None) -> list:
    """The first turn of the first ``per_task`` questions of each task, texts cut to ``max_chars``."""
    turns = [q.turns[0] for q in load_questions(path, per_task)]
    return [t[:max_chars] if max_chars is not None and isinstance(t, str) else t for t in turns]


class PromptBuilder:
    """Token ids of a turn: the chat template when the tokenizer has one, else the raw text; turn i > 0
    sees the previous turns and the reference's answers to them."""

    def __init__(self, tokenizer, encode: Callable):
        self.tokenizer = tokenizer
        self.encode = encode
        self.chat = bool(tokenizer is not None and getattr(tokenizer, "chat_template", None))

    def __call__(self, q: Question, turn: int, answers: Sequence) -> list[int]:
        turns = q.turns[: turn + 1]
        if all(not isinstance(t, str) for t in turns):  # pre-tokenized: concatenate ids
            ids: list[int] = []
            for i, t in enumerate(turns):
                ids += list(t) + (list(answers[i]) if i < turn else [])
            return self.encode(ids)
        if any(not isinstance(t, str) for t in turns):
            raise ValueError(f"question {q.question_id}: mixes text and token-id turns")
        texts = [self.tokenizer.decode(a, skip_special_tokens=True) for a in answers[:turn]]
        if self.chat:
            msgs = []
            for i, t in enumerate(turns):
                msgs.append({"role": "user", "content": t})
                if i < turn:
                    msgs.append({"role": "assistant", "content": texts[i]})
            return self.encode(msgs, apply_chat_template=True)
        parts = []
        for i, t in enumerate(turns):
            parts += [t] + ([texts[i]] if i < turn else [])
        return self.encode("\n\n".join(parts))


# Never among the measured prompts: the warm-up must not train an engine on a prompt it is then timed
# on. Repeated phrases, so that the drafting methods draft (and the auto budget calibrates) here too.
WARMUP_TEXT = ("This is a warm-up request and is never measured. Repeat the list twice, word for word: "
               "red apples, green pears, yellow lemons, purple plums. "
               "red apples, green pears, yellow lemons, purple plums.")


def warmup_question(tokenizer, vocab_size: int) -> Question:
    """The warm-up's question: :data:`WARMUP_TEXT`, or (for a model without a tokenizer) its UTF-8
    bytes as token ids modulo ``vocab_size``."""
    turn = WARMUP_TEXT if tokenizer is not None else tuple(b % vocab_size for b in WARMUP_TEXT.encode())
    return Question("warm-up", "warm-up", (turn,))
