"""Token counting for sizing generated rows: a real tokenizer, or characters / 4 without one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["TokenCounter", "make_counter", "CHARS_PER_TOKEN"]

CHARS_PER_TOKEN = 4  # the approximation used without a tokenizer (Gemma 3 on English and Python: about 4)


@dataclass(frozen=True)
class TokenCounter:
    """Counts tokens of texts, without special tokens. ``name`` says how (stored in generated rows)."""

    name: str
    tokenizer: Any = None  # a Hugging Face tokenizer; None: characters / CHARS_PER_TOKEN

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Token counts of ``texts``, one call (the tokenizer batches them)."""
        if not texts:
            return []
        if self.tokenizer is None:
            return [math.ceil(len(t) / CHARS_PER_TOKEN) for t in texts]
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]

    def count(self, text: str) -> int:
        """Token count of one text."""
        return self.count_many([text])[0]


def make_counter(spec: str) -> TokenCounter:
    """``"none"``: characters / 4. Else a model spec of :func:`logitspec.models.resolve_model_path`
    (``"default"``: the embedded Gemma 3 270M), whose tokenizer is loaded without the model."""
    if spec == "none":
        return TokenCounter(name=f"chars/{CHARS_PER_TOKEN}")
    from transformers import AutoTokenizer

    from ..models import resolve_model_path

    path = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return TokenCounter(name=f"tokenizer:{path.name}", tokenizer=tokenizer)
