"""The rows of an evaluation sweep: each LongBench example as the prompt a model is given.

A row is the dataset's template filled with the example, cut in the middle to the model's maximum
input (LongBench's ``pred.py``; for LongBench v2 its own ``pred.py``'s template and cut), with the
dataset's maximum new tokens (optionally capped) and its stop rule (:func:`stop_strings`). No engine
here: the tokenizer only counts and cuts tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from . import longbench_v2 as v2_spec
from .longbench import Example
from .longbench_v2 import ExampleV2, is_v2_name
from .prompts import TokenizerLike, build_prompt, dataset_spec

__all__ = ["CHAT_MARGIN", "SweepRow", "input_limit", "sweep_rows", "stop_strings", "official_stop_length"]

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
        return {"key": self.key, "dataset": self.dataset, "example_id": self.example_id,
                "prompt": self.prompt,
                "max_new_tokens": self.max_new_tokens, "stop": list(self.stop), "chat": self.chat,
                "truncated": self.truncated}


def input_limit(max_context: int, max_new_tokens: int, max_length: int | None = None) -> int:
    """Tokens a prompt may keep: ``max_length`` if given, else the context less the answer and
    :data:`CHAT_MARGIN` (as LongBench's ``model2maxlen`` leaves room below the window)."""
    limit = max_length if max_length is not None else max_context - max_new_tokens - CHAT_MARGIN
    if limit < 2:
        raise ValueError(f"no room for a prompt: context {max_context}, {max_new_tokens} new tokens")
    return limit


def sweep_rows(data: Mapping[str, Sequence[Example | ExampleV2]], tokenizer: TokenizerLike,
               max_context: int, *,
               max_new_cap: int | None = None, max_length: int | None = None,
               chat_template: bool = False) -> list[SweepRow]:
    """The rows of every example, dataset by dataset in file order (``ValueError`` on a repeated key).

    ``max_new_cap``: at most this many new tokens (LongBench's own length when smaller);
    ``chat_template``: the tokenizer has one; a dataset whose rule is ``chat`` then uses it (LongBench
    v2 always: its ``pred.py`` sends a chat message).
    """
    rows, seen = [], set()
    for name, examples in data.items():
        v2 = is_v2_name(name)
        spec = None if v2 else dataset_spec(name)
        own = v2_spec.MAX_NEW_TOKENS if v2 else spec.max_new_tokens
        max_new = own if max_new_cap is None else min(own, max_new_cap)
        limit = input_limit(max_context, max_new, max_length)
        for e in examples:
            key = f"{name}/{e.id}"
            if key in seen:
                raise ValueError(f"{name}: _id {e.id!r} appears twice; a sweep needs unique ids per dataset")
            seen.add(key)
            if v2:  # pred.py sends the prompt as a chat user message
                full = v2_spec.format_v2_prompt(e)
                prompt = v2_spec.truncate_v2(full, tokenizer, limit)
                rows.append(SweepRow(key=key, dataset=name, example_id=e.id, prompt=prompt,
                                     max_new_tokens=max_new, stop=(), chat=chat_template,
                                     truncated=prompt != full))
                continue
            full = spec.prompt.format(context=e.context, input=e.input)
            prompt = build_prompt(name, e.context, e.input, tokenizer, limit)
            rows.append(SweepRow(key=key, dataset=name, example_id=e.id, prompt=prompt,
                                 max_new_tokens=max_new, stop=stop_strings(name),
                                 chat=spec.chat and chat_template,
                                 truncated=prompt != full))
    return rows


def stop_strings(name: str) -> tuple[str, ...]:
    r"""The stop strings a dataset's rows give the engine: none for any LongBench dataset.

    samsum (``stop_at_newline``): LongBench's ``pred.py`` stops on the newline *token* and only after
    the first new token (``eos_token_id=[eos, <"\n" token>]``, ``min_length=context_length + 1``),
    so a generation that begins with a newline goes on to the next line. A stop *string* ``"\n"``
    would end it there, with "" as the text (the engine drops the stop string), scoring 0. Without a
    stop the row runs to its 128 tokens or EOS, and ``eval.py``'s rule (the first line after leading
    newlines, :func:`logitspec.evaluation.scoring.score_prediction`) scores the line the official run
    stops after. :func:`official_stop_length` cuts such a row's tokens where ``pred.py`` would have.
    """
    dataset_spec(name)  # UnknownDatasetError for a name no config knows
    return ()


def official_stop_length(token_ids: Sequence[int], stop_ids: Iterable[int], min_new_tokens: int = 1) -> int:
    """How many of ``token_ids`` a ``generate`` with ``eos_token_id=stop_ids`` and
    ``min_length=context_length + min_new_tokens`` keeps: through the first stop id at an index of at
    least ``min_new_tokens`` (the stop token included, as ``generate`` returns it), else all.

    (``generate`` also never *chooses* a stop id before ``min_new_tokens``; a stop id there, which an
    engine without that rule may give, is kept as text.)
    """
    stops = set(int(t) for t in stop_ids)
    for i, t in enumerate(token_ids):
        if i >= min_new_tokens and int(t) in stops:
            return i + 1
    return len(token_ids)
