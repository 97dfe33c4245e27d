"""The rows of an evaluation sweep: each LongBench example as the prompt a model is given.

A row is the dataset's template filled with the example, cut in the middle to the model's maximum
input (LongBench's ``pred.py``), with the dataset's maximum new tokens (optionally capped) and its stop
rule. No engine here: the tokenizer only counts and cuts tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .longbench import Example
from .prompts import TokenizerLike, build_prompt, dataset_spec

__all__ = ["CHAT_MARGIN", "SweepRow", "input_limit", "sweep_rows"]

# tokens left free besides the answer: a chat template's wrapping and re-tokenization drift after the cut
CHAT_MARGIN = 64


@dataclass(frozen=True)
class SweepRow:
    """One example ready to generate. ``key`` (``<dataset>/<_id>``) is unique within a sweep."""

    key: str
    dataset: str
    example_id: str
    prompt: str
    max_new_tokens: int
    stop: tuple[str, ...]
    chat: bool  # wrap the prompt in the tokenizer's chat template
    truncated: bool

    def as_dict(self) -> dict:
        return {"key": self.key, "dataset": self.dataset, "example_id": self.example_id, "prompt": self.prompt,
                "max_new_tokens": self.max_new_tokens, "stop": list(self.stop), "chat": self.chat,
                "truncated": self.truncated}


def input_limit(max_context: int, max_new_tokens: int, max_length: int | None = None) -> int:
    """Tokens a prompt may keep: ``max_length`` if given, else the context less the answer and
    :data:`CHAT_MARGIN` (as LongBench's ``model2maxlen`` leaves room below the window)."""
    limit = max_length if max_length is not None else max_context - max_new_tokens - CHAT_MARGIN
    if limit < 2:
        raise ValueError(f"no room for a prompt: context {max_context}, {max_new_tokens} new tokens")
    return limit


def sweep_rows(data: Mapping[str, Sequence[Example]], tokenizer: TokenizerLike, max_context: int, *,
               max_new_cap: int | None = None, max_length: int | None = None,
               chat_template: bool = False) -> list[SweepRow]:
    """The rows of every example, dataset by dataset in file order (``ValueError`` on a repeated key).

    ``max_new_cap``: at most this many new tokens (LongBench's own length when smaller);
    ``chat_template``: the tokenizer has one; a dataset whose rule is ``chat`` then uses it.
    """
    rows, seen = [], set()
    for name, examples in data.items():
        spec = dataset_spec(name)
        max_new = spec.max_new_tokens if max_new_cap is None else min(spec.max_new_tokens, max_new_cap)
        limit = input_limit(max_context, max_new, max_length)
        for e in examples:
            key = f"{name}/{e.id}"
            if key in seen:
                raise ValueError(f"{name}: _id {e.id!r} appears twice; a sweep needs unique ids per dataset")
            seen.add(key)
            full = spec.prompt.format(context=e.context, input=e.input)
            prompt = build_prompt(name, e.context, e.input, tokenizer, limit)
            rows.append(SweepRow(key=key, dataset=name, example_id=e.id, prompt=prompt, max_new_tokens=max_new,
                                 stop=("\n",) if spec.stop_at_newline else (), chat=spec.chat and chat_template,
                                 truncated=prompt != full))
    return rows
