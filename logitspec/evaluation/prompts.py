"""LongBench v1 prompt templates, generation lengths and middle truncation.

The templates and settings are data, in ``longbench_config.json`` next to this module (LongBench's
``config/dataset2prompt.json`` and ``config/dataset2maxlen.json``, the metric of ``eval.py`` and the
per-dataset rules of ``pred.py``), plus this project's own local datasets marked ``origin: logitspec``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol, Sequence

__all__ = [
    "DatasetSpec",
    "UnknownDatasetError",
    "TokenizerLike",
    "dataset_names",
    "longbench_e_names",
    "resolve_name",
    "dataset_spec",
    "format_prompt",
    "truncate_middle",
    "build_prompt",
]

CONFIG_FILE = "longbench_config.json"
E_SUFFIX = "_e"


class UnknownDatasetError(ValueError):
    """A dataset name that is neither a LongBench v1 dataset, a LongBench-E file nor a local one."""


@dataclass(frozen=True)
class DatasetSpec:
    """How one dataset is prompted and scored.

    ``chat``: LongBench's ``pred.py`` wraps the prompt in a chat model's template (False for trec,
    triviaqa, samsum, lsht, lcc, repobench-p, whose prompts are few-shot or code continuations).
    ``first_line``: ``eval.py`` scores only the first line of the prediction (trec, triviaqa, samsum, lsht).
    ``stop_at_newline``: ``pred.py`` stops generation at the newline token, after the first new token
    (samsum; an evaluation sweep gives no stop string, see :func:`.sweep_rows.stop_strings`).
    ``origin``: ``"longbench"``, or ``"logitspec"`` for this project's local datasets.
    """

    name: str
    origin: str
    language: str
    prompt: str
    max_new_tokens: int
    metric: str
    chat: bool
    first_line: bool
    stop_at_newline: bool
    longbench_e: bool


class TokenizerLike(Protocol):
    """What truncation needs: a Hugging Face tokenizer or anything with these two methods."""

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@functools.lru_cache(maxsize=1)
def _specs() -> dict[str, DatasetSpec]:
    text = resources.files(__package__).joinpath(CONFIG_FILE).read_text(encoding="utf-8")
    raw: dict[str, dict[str, Any]] = json.loads(text)["datasets"]
    return {name: DatasetSpec(name=name, **fields) for name, fields in raw.items()}


def dataset_names(origin: str | None = None) -> tuple[str, ...]:
    """Dataset names in config order, all or those of one ``origin`` (``longbench`` / ``logitspec``)."""
    return tuple(n for n, s in _specs().items() if origin is None or s.origin == origin)


def longbench_e_names() -> tuple[str, ...]:
    """The 13 datasets that LongBench-E also has (files ``<name>_e.jsonl``)."""
    return tuple(n for n, s in _specs().items() if s.longbench_e)


def resolve_name(name: str) -> tuple[str, bool]:
    """``(dataset, is LongBench-E)`` for a file's dataset name: ``qasper_e`` -> ``("qasper", True)``."""
    specs = _specs()
    if name in specs:
        return name, False
    base = name[: -len(E_SUFFIX)] if name.endswith(E_SUFFIX) else None
    if base is not None and base in specs and specs[base].longbench_e:
        return base, True
    raise UnknownDatasetError(
        f"unknown dataset {name!r}; known: {', '.join(specs)}; LongBench-E files: "
        f"{', '.join(n + E_SUFFIX for n in longbench_e_names())}"
    )


def dataset_spec(name: str) -> DatasetSpec:
    """The spec of ``name`` (a LongBench-E name gets its base dataset's spec)."""
    return _specs()[resolve_name(name)[0]]


def format_prompt(name: str, context: str, input: str) -> str:
    """The dataset's template filled with a row's ``context`` and ``input`` (as ``pred.py`` does)."""
    return dataset_spec(name).prompt.format(context=context, input=input)


def truncate_middle(prompt: str, tokenizer: TokenizerLike, max_length: int) -> str:
    """LongBench's middle truncation: a prompt of more than ``max_length`` tokens keeps its first and
    last ``max_length // 2`` tokens, decoded (special tokens skipped) and joined; shorter ones are
    returned unchanged.

    Tokens are counted as ``pred.py`` counts them, with the tokenizer's special tokens (``encode``'s
    default). Re-tokenizing the result may give a slightly different count, as in LongBench.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    ids = list(tokenizer.encode(prompt))
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail


def build_prompt(name: str, context: str, input: str, tokenizer: TokenizerLike, max_length: int) -> str:
    """:func:`format_prompt` then :func:`truncate_middle`: the text LongBench feeds a model (before any
    chat template, see :attr:`DatasetSpec.chat`)."""
    return truncate_middle(format_prompt(name, context, input), tokenizer, max_length)
