"""What a drafter is: the node kinds of a draft tree (where a node came from; the auto budget learns one
acceptance rate per kind) and the :class:`Drafter` interface, which is also plain decoding (no drafts).
The drafters of the methods are in :mod:`logitspec.spec_decode.drafters` (and
:mod:`logitspec.spec_decode.lookahead`).

All drafters are pure given their inputs: the same context, root, guesses and row state give the
same tree, which keeps tree sampling exact (drafts must not depend on the target's random draws).
A drafter with state of its own per row (lookahead's window and pool) makes it with :meth:`new_state`
(the row keeps it) and updates it in :meth:`observe` from the target's token after every node of the
verified tree (``wants_node_outputs``: the step computes them only for such a drafter).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from logitspec.config import SpecConfig
from logitspec.spec_decode.ngram_index import NgramSource
from logitspec.spec_decode.tree import DraftTree

__all__ = ["IS_LOOKUP", "KIND", "KINDS", "LOOKUP_KINDS", "MAX_ORDER_KINDS", "N_KINDS", "RANK_BUCKETS",
           "Drafter", "guess_kind", "lookup_kind"]

RANK_BUCKETS = (1, 2, 4, 8, 16, 32)  # guess branches learn acceptance per bucket of the guess's rank
MAX_ORDER_KINDS = 2  # lookup chains matched on 1..MAX_ORDER_KINDS tokens get kinds of their own

# Node kinds: where a draft node came from. The auto budget learns one acceptance rate per kind (and
# offset within its chain), so a kind groups nodes that are equally good bets.
KINDS = (
    "root",
    "lookup",  # the plain lookup chain of x1, matched on the longest n-gram (max_ngram tokens)
    *(f"guess_rank<={r}" for r in RANK_BUCKETS),  # a branch starting with a next-next guess
    f"guess_rank>{RANK_BUCKETS[-1]}",
    *(f"lookup_order={o}" for o in range(1, MAX_ORDER_KINDS + 1)),  # lookup matched on fewer tokens
    "lookahead_window",  # a node of lookahead's Jacobi window (logitspec.spec_decode.lookahead)
    "lookahead_pool",  # a node of an n-gram from lookahead's pool
)
KIND = {name: i for i, name in enumerate(KINDS)}
N_KINDS = len(KINDS)
LOOKUP_KINDS = tuple(i for name, i in KIND.items() if name.startswith("lookup"))
IS_LOOKUP = np.isin(np.arange(N_KINDS), LOOKUP_KINDS)  # bool [N_KINDS]: IS_LOOKUP[tree.kinds] marks chains


def guess_kind(rank: int) -> int:
    """Node kind of a guess branch by the guess's 1-based rank."""
    bucket = next((r for r in RANK_BUCKETS if rank <= r), None)
    return KIND[f"guess_rank<={bucket}" if bucket else f"guess_rank>{RANK_BUCKETS[-1]}"]


def lookup_kind(order: int, max_ngram: int) -> int:
    """Node kind of a lookup chain by the length of the n-gram it matched: a 3-gram match is a far
    better bet than a 1-gram one, so shorter matches learn their own acceptance rates."""
    if order >= max_ngram or order > MAX_ORDER_KINDS or order < 1:
        return KIND["lookup"]
    return KIND[f"lookup_order={order}"]


class Drafter:
    """No drafts: plain autoregressive decoding in the same engine (the reference)."""

    wants_guesses = False
    wants_node_outputs = False  # observe() needs the target's token after every node
    keeps_state = False  # draft() reads the row's state (new_state); True wherever wants_node_outputs
    fixed_shape = False  # the tree's size is the method's: capped by the context, not the tokens left

    def __init__(self, config: SpecConfig):
        self.config = config

    def base_budget(self) -> int:
        return 0

    def draft(self, sources: Sequence[NgramSource], context: Sequence[int], guesses: Sequence[int],
              budget: int, state: Any = None) -> DraftTree:
        """``context`` ends with the root token (already emitted, not yet in the cache); ``state``:
        the row's (:meth:`new_state`)."""
        return DraftTree.single(context[-1])

    def new_state(self, prompt: Sequence[int]) -> Any:
        """A new row's drafting state (None: the drafter keeps none)."""
        return None

    def observe(self, state: Any, tree: DraftTree, path: Sequence[int], outputs: Sequence[int]) -> None:
        """After a verified step: ``outputs[i]``, the target's token after node i of ``tree`` (the argmax;
        when sampling, of the node's scores); ``path``: the accepted nodes. Called only when
        ``wants_node_outputs``."""
