"""One row of the batch: a request's sample being decoded, with its own settings, and its result.

A :class:`DecodingSequence` holds everything that differs between rows of one batch: the sampling
settings and generator, the token limit, the stop strings, the n-gram sources it drafts from, the
next-next guesses and acceptance streak the speculation policy reads, and the tokens emitted so far.
The session owns the sequences; the policy sees them through :class:`~logitspec.spec_decode.policy.DraftRow`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from logitspec.engine.stats import SequenceStats
from logitspec.engine.stops import stop_cut
from logitspec.sample.params import SamplingParams
from logitspec.spec_decode.ngram_index import NgramSource, SequenceIndex, SiblingSource


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    request_id: int = 0  # the prompt's index in run() / its id from Session.submit
    sample_index: int = 0  # which of the prompt's n samples


@dataclass
class DecodingSequence:
    """Decoding state of one sample of one request."""

    key: tuple[int, int]  # (request id, sample index)
    prompt_len: int
    max_new: int
    index: SequenceIndex  # prompt + emitted tokens; the last one is the root (not yet cached)
    params: SamplingParams
    generator: torch.Generator | None  # None when greedy
    stops: list[str] = field(default_factory=list)
    sources: list[NgramSource] = field(default_factory=list)
    source_names: list[str] = field(default_factory=list)  # per source: one of stats.ORIGINS but "guess"
    stats: SequenceStats = field(default_factory=SequenceStats)
    out: list[int] = field(default_factory=list)
    guesses: list[int] = field(default_factory=list)
    finish: str | None = None
    streak: int = 0  # the acceptance-rate state: budget.streak_state of its previous step's accepted drafts
    draft_state: Any = None  # the drafter's own state for this row (lookahead: its window and pool)

    @classmethod
    def start(cls, key: tuple[int, int], prompt_ids: list[int], max_new: int, params: SamplingParams,
              seed: int, stops: list[str], sources: list[tuple[Any, str]], max_ngram: int, min_ngram: int,
              siblings: list | None = None) -> "DecodingSequence":
        """A sequence for a prefilled prompt, before its first token. ``sources``: (n-gram source or
        None, origin name) consulted after its own context and ``siblings`` (the list shared by the
        prompt's samples, see :class:`~logitspec.spec_decode.ngram_index.SiblingSource`; None: sampled
        once)."""
        gen = None if params.greedy else torch.Generator().manual_seed(int(seed))
        seq = cls(key=key, prompt_len=len(prompt_ids), max_new=max_new,
                  index=SequenceIndex(prompt_ids, max_ngram, min_ngram), params=params, generator=gen,
                  stops=stops)
        near = None
        if siblings is not None:
            siblings.append(seq.index)
            near = SiblingSource(siblings, seq.index)
        named = [(seq.index, "context"), (near, "siblings"), *sources]
        seq.sources = [src for src, _ in named if src is not None]
        seq.source_names = [name for src, name in named if src is not None]
        return seq

    # ------------------------------------------------------------------ what drafting reads
    @property
    def tokens(self) -> list[int]:
        """Prompt and emitted tokens; the last is the next tree's root."""
        return self.index.tokens

    @property
    def length(self) -> int:
        """Prompt and emitted tokens (the root included)."""
        return len(self.index)

    @property
    def remaining(self) -> int:
        """Tokens it may still emit."""
        return self.max_new - len(self.out)

    @property
    def drafted_rate(self) -> float:
        """Tokens per step over its last ``stats.RATE_STEPS`` steps that verified draft nodes (1 before
        any): what a step gives it when it drafts, whatever the budget gave it since."""
        recent = self.stats.drafted_recent
        return sum(recent) / len(recent) if recent else 1.0

    # ------------------------------------------------------------------ emitting
    def emit(self, tokens: list[int], eos_ids: set[int], tokenizer) -> int:
        """Append accepted tokens, stopping at EOS, a stop string or the length limit; returns how
        many were kept."""
        kept = []
        for t in tokens:
            kept.append(t)
            if t in eos_ids:
                self.finish = "stop"
                break
            if len(self.out) + len(kept) >= self.max_new:
                self.finish = "length"
                break
        if self.stops:
            before = len(self.out)
            cut = stop_cut(tokenizer, self.out + kept, before, self.stops)
            if cut is not None:
                kept = kept[: cut - before]
                self.finish = "stop"
        self.out.extend(kept)
        self.index.extend(kept)
        return len(kept)

    def result(self, tokenizer) -> GenerationResult:
        """The finished (or stopped) sequence's result."""
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(self.out, skip_special_tokens=True)
            for s in self.stops:  # like vLLM: the stop string itself is not part of the text
                if s in text:
                    text = text[: text.index(s)]
        prompt_ids = self.index.tokens[:self.prompt_len]
        return GenerationResult(self.out, text, self.finish or "length", self.stats.as_dict(),
                                [int(t) for t in prompt_ids], self.key[0], self.key[1])
