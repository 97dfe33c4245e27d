"""Per-sequence decoding statistics."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ORIGINS = ("context", "siblings", "reference", "history", "guess")  # where accepted draft tokens came from
RATE_STEPS = 8  # a row's tokens per drafting step: the mean over this many of its last ones


@dataclass
class SequenceStats:
    """Accumulated per target forward; ``accepted_lengths`` sums to the tokens emitted."""

    accepted_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    retrieved_steps: int = 0
    draft_s: float = 0.0
    pack_s: float = 0.0
    forward_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    prefill_s: float = 0.0
    shared_prefill: bool = False  # the prompt's KV was copied from a sibling sample (n > 1)
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from a prefix cache
    max_step_gap_s: float = 0.0  # longest time between two forwards that emitted tokens for the row
    last_emit_t: float | None = field(default=None, repr=False)
    # accepted draft tokens by the source that supplied them (guess: a next-next guess from the logits)
    accepted_from: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORIGINS, 0))
    # tokens emitted by its last RATE_STEPS steps that verified draft nodes
    drafted_recent: deque = field(default_factory=lambda: deque(maxlen=RATE_STEPS), repr=False)

    def count_origins(self, names: list[str]) -> None:
        """Count accepted draft tokens by their source (names from :data:`ORIGINS`)."""
        for name in names:
            self.accepted_from[name] += 1

    def mark_emit(self, t: float) -> None:
        """Note that a forward emitted tokens for the row at ``t`` (``time.perf_counter()``)."""
        if self.last_emit_t is not None:
            self.max_step_gap_s = max(self.max_step_gap_s, t - self.last_emit_t)
        self.last_emit_t = t

    def add_step(self, emitted: int, retrieved: bool, tree_size: int = 0, draft_s: float = 0.0,
                 pack_s: float = 0.0, forward_s: float = 0.0, verify_s: float = 0.0,
                 commit_s: float = 0.0) -> None:
        self.accepted_lengths.append(emitted)
        self.tree_sizes.append(tree_size)
        if tree_size > 0:
            self.drafted_recent.append(emitted)
        self.retrieved_steps += bool(retrieved)
        self.draft_s += draft_s
        self.pack_s += pack_s
        self.forward_s += forward_s
        self.verify_s += verify_s
        self.commit_s += commit_s

    def as_dict(self) -> dict:
        steps = len(self.accepted_lengths)
        # the prefill forward drafts nothing, so retrieval success counts decode steps only
        decode_steps = max(steps - 1, 0)
        return {
            "steps": steps,
            "accepted_lengths": list(self.accepted_lengths),
            "mean_accepted": sum(self.accepted_lengths) / steps if steps else 0.0,
            "retrieval_success": self.retrieved_steps / decode_steps if decode_steps else 0.0,
            "mean_tree_size": sum(self.tree_sizes[1:]) / decode_steps if decode_steps else 0.0,
            # decode steps whose tree held a drafted node (the budget chose to verify a draft)
            "verified_steps": sum(1 for size in self.tree_sizes[1:] if size > 0),
            "prefill_s": self.prefill_s,
            "shared_prefill": self.shared_prefill,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "accepted_from": dict(self.accepted_from),
            "max_step_gap_s": self.max_step_gap_s,
            "draft_s": self.draft_s,
            "pack_s": self.pack_s,
            "forward_s": self.forward_s,
            "verify_s": self.verify_s,
            "commit_s": self.commit_s,
            "wall_s": self.prefill_s + self.draft_s + self.pack_s + self.forward_s + self.verify_s
            + self.commit_s,
        }
