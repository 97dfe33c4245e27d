"""Engine and drafter configuration: one frozen dataclass, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, replace

METHODS = ("ar", "pld", "logitspec", "rest", "lookahead")
# the model runner: auto = the graph runner on CUDA, eager elsewhere; compiled = the graph runner with
# its steps compiled by inductor
RUNNERS = ("auto", "eager", "graph", "compiled")
RUNNER_HELP = ("the model runner: auto (CUDA graphs on CUDA, eager elsewhere), eager, graph (static slots, a "
               "CUDA graph per shape bucket; off CUDA without capture) or compiled (graph with each bucket's "
               "step compiled by inductor first: one compile per bucket at start-up)")


@dataclass(frozen=True)
class SpecConfig:
    """How the engine drafts and batches.

    Defaults for the draft budget are sized for this project's CPU target (a k-token forward costs
    far more than a 1-token one there); ``SpecConfig.paper()`` gives the paper's A100 settings.
    """

    method: str = "logitspec"
    # the model runner (logitspec.worker.gpu.runner_for): "auto" (CUDA graphs on CUDA, eager elsewhere),
    # "eager", "graph" (the static-slot runner; on CPU its static path without capture), or "compiled"
    # (the graph runner, each step compiled by inductor before its capture: a compile per shape bucket)
    runner: str = "auto"
    # --- batching
    max_batch_size: int = 1
    # while rows decode, free slots wait for company until their idle slot-steps since the last refill
    # reach this many decoding steps of the whole batch (refill_wait x max_batch_size), or half the
    # batch is free; rows finishing one by one (speculation makes them) are then refilled several to
    # a prefill forward. Such a forward's fixed cost is about 0.65 of a 24-row decoding step here
    # (docs/engine.md, "The loop"); waiting until the idle cost matches it loses at most twice what
    # the best choice knowing the future would (the ski-rental rule). 0: every free slot at once.
    refill_wait: float = 0.5
    # --- n-gram retrieval (shared by pld and logitspec)
    max_ngram: int = 3
    min_ngram: int = 1
    # --- pld: one chain of up to this many tokens (Spec-Bench: 10)
    pld_max_tokens: int = 10
    # --- the draft budget of every drafting method but lookahead (whose tree has a fixed shape)
    # "auto": each step verifies the draft nodes that maximise expected tokens per second, from the
    # measured cost curve and running acceptance rates (up to the method's tree: ``capacity`` for
    # logitspec); "fixed": always the method's whole tree (scaled down with the batch by
    # ``budget_decay``), as in the paper.
    budget: str = "auto"
    # --- logitspec
    capacity: int = 32  # max draft nodes per sequence and step, root excluded
    top_k: int = 32  # next-next guesses taken from the last logits (x1 excluded)
    # the plain lookup continuation of x1, inserted first: 0 lets it grow to the step's budget, so at any
    # budget a logitspec tree holds the pld chain (which stops at pld_max_tokens)
    branch0_max_tokens: int = 0
    # rank pruning: a guess of rank r (1-based) keeps rank_keep[i] tokens if r <= rank_limits[i]
    rank_limits: tuple[int, ...] = (8, 32)
    rank_keep: tuple[int, ...] = (4, 3)
    rank_keep_else: int = 1
    continuations_per_key: int = 1  # distinct continuations retrieved per n-gram key
    # the order guess branches are added in: "logits" (the paper's: by the guess's rank in the last
    # logits) or "context" (guesses whose (root, guess) n-gram the context holds first, each group in
    # logit order; measured in docs/benchmarks.md)
    guess_order: str = "logits"
    # --- rest (logitspec.spec_decode.rest; REST's defaults): the longest context suffix of rest_max_span
    # down to
    # rest_min_span tokens found in the datastore (the row's reference, if a rest.Datastore; else the
    # row's own context), continuations of up to rest_continuation tokens after its first
    # rest_max_matches occurrences, merged into a trie cut to its rest_num_draft most frequent nodes
    rest_max_span: int = 16
    rest_min_span: int = 2
    rest_num_draft: int = 64
    rest_max_matches: int = 5000
    rest_continuation: int = 10
    # --- lookahead (logitspec.spec_decode.lookahead; LADE's recommended N, W, G): a Jacobi window of
    # lookahead_window columns and lookahead_level - 1 levels, n-grams of lookahead_level tokens, up to
    # lookahead_guesses of them kept per first token and verified per step
    lookahead_window: int = 7
    lookahead_level: int = 5
    lookahead_guesses: int = 7
    # with several samples per prompt, a sample also retrieves from its siblings' answers so far
    # (after its own context, before the reference corpus)
    sibling_drafts: bool = True
    # Scale per-sequence capacity with the number of active sequences: capacity / active ** budget_decay.
    budget_decay: float = 1.0
    min_capacity: int = 2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.budget not in ("auto", "fixed"):
            raise ValueError(f"budget must be 'auto' or 'fixed', got {self.budget!r}")
        if self.guess_order not in ("logits", "context"):
            raise ValueError(f"guess_order must be 'logits' or 'context', got {self.guess_order!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not self.refill_wait >= 0:
            raise ValueError(f"refill_wait must be >= 0, got {self.refill_wait}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        for name in ("pld_max_tokens", "capacity", "top_k", "branch0_max_tokens", "continuations_per_key"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 1 <= self.rest_min_span <= self.rest_max_span:
            raise ValueError(f"need 1 <= rest_min_span <= rest_max_span, got {self.rest_min_span}, "
                             f"{self.rest_max_span}")
        for name in ("rest_num_draft", "rest_max_matches", "rest_continuation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lookahead_window < 1 or self.lookahead_level < 3 or self.lookahead_guesses < 0:
            raise ValueError("need lookahead_window >= 1, lookahead_level >= 3, lookahead_guesses >= 0, got "
                             f"{self.lookahead_window}, {self.lookahead_level}, {self.lookahead_guesses}")
        if len(self.rank_limits) != len(self.rank_keep):
            raise ValueError("rank_limits and rank_keep must have the same length")
        if list(self.rank_limits) != sorted(self.rank_limits):
            raise ValueError(f"rank_limits must be increasing, got {self.rank_limits}")
        if self.budget_decay < 0:
            raise ValueError(f"budget_decay must be >= 0, got {self.budget_decay}")

    def keep_for_rank(self, rank: int) -> int:
        """Tokens kept in the branch of the guess with 1-based ``rank`` (the guess included)."""
        for limit, keep in zip(self.rank_limits, self.rank_keep):
            if rank <= limit:
                return keep
        return self.rank_keep_else

    def budget_for(self, base: int, active: int) -> int:
        """Per-sequence draft nodes when ``active`` sequences share one forward: ``base`` at batch 1,
        shrinking as ``base / active ** budget_decay`` (never below ``min_capacity``, never above base)."""
        if active <= 1 or self.budget_decay == 0 or base == 0:
            return base
        return min(base, max(self.min_capacity, int(base / active**self.budget_decay)))

    def with_(self, **changes) -> "SpecConfig":
        return replace(self, **changes)

    @classmethod
    def paper(cls, **changes) -> "SpecConfig":
        """The paper's A100 defaults: capacity 64, k 64, branch 0 up to 20, no batch scaling."""
        base = dict(capacity=64, top_k=64, branch0_max_tokens=20, budget_decay=0.0, budget="fixed")
        base.update(changes)
        return cls(**base)
