"""LongBench-format rows as bench questions: each row's prompt built as the evaluation sweep builds it
(the dataset's template, middle truncation to the model's context, its chat rule) and tokenized, with its
dataset's own answer length. A dataset is a task of its own in the bench's tables."""
from __future__ import annotations

import pathlib
from typing import Callable

from .questions import Question

# the LongBench-format set shipped with the repository (5 data sets, 3 rows each)
LONGBENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "data" / "longbench_local"


def longbench_questions(directory, tokenizer, encode: Callable, max_context: int, per_task: int | None = None,
                        max_new_cap: int | None = None) -> list[Question]:
    """The first ``per_task`` rows of each data set in ``directory`` (all: None), file order, as
    one-turn questions of token ids; ``encode(text, chat)`` tokenizes (an engine's ``encode``).
    ``max_new_cap``: at most this many new tokens (a data set's own length when smaller)."""
    from ..evaluation.longbench import read_directory
    from ..evaluation.sweep_rows import sweep_rows

    if per_task is not None and per_task < 1:
        raise ValueError(f"per_task must be >= 1, got {per_task}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    rows = sweep_rows(read_directory(directory), tokenizer, max_context, max_new_cap=max_new_cap,
                      chat_template=chat)
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        taken[r.dataset] = taken.get(r.dataset, 0) + 1
        if per_task is None or taken[r.dataset] <= per_task:
            out.append(Question(r.key, r.dataset, (tuple(encode(r.prompt, r.chat)),), r.max_new_tokens))
    return out
