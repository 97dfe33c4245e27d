"""Drafters: turn a sequence's context (+ the last logits' guesses) into a draft tree.

All drafters are pure given their inputs: the same context, root, guesses and row state give the
same tree, which keeps tree sampling exact (drafts must not depend on the target's random draws).
A drafter with state of its own per row (lookahead's window and pool) makes it with :meth:`new_state`
(the row keeps it) and updates it in :meth:`observe` from the target's token after every node of the
verified tree (``wants_node_outputs``: the step computes them only for such a drafter).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .config import SpecConfig
from .index import NgramSource, retrieve_with_order
from .tree import GUESS, DraftTree, TreeBuilder

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
    "lookahead_window",  # a node of lookahead's Jacobi window (logitspec.lookahead)
    "lookahead_pool",  # a node of an n-gram from lookahead's pool
)
KIND = {name: i for i, name in enumerate(KINDS)}
N_KINDS = len(KINDS)
LOOKUP_KINDS = tuple(i for name, i in KIND.items() if name.startswith("lookup"))


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


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: one chain continuing the longest matching suffix n-gram."""

    def base_budget(self) -> int:
        return self.config.pld_max_tokens

    def draft(self, sources, context, guesses, budget, state=None):
        c = self.config
        b = TreeBuilder(context[-1], budget)
        hits, _, src = retrieve_with_order(sources, context, min(budget, c.pld_max_tokens), 1, c.max_ngram,
                                           c.min_ngram)
        if hits:
            b.retrieved = b.add_chain(hits[0], kind=KIND["lookup"], origin=src) > 0
        return b.build()


class LogitSpecDrafter(Drafter):
    """LogitSpec: branch 0 continues the root; branch j starts with the j-th next-next guess
    taken from the last logits and continues the n-gram ending in (root, guess)."""

    wants_guesses = True

    def base_budget(self) -> int:
        return self.config.capacity

    def draft(self, sources, context, guesses, budget, state=None):
        c = self.config
        b = TreeBuilder(context[-1], budget)
        chains, order, src = retrieve_with_order(sources, context, c.branch0_max_tokens,
                                                 c.continuations_per_key, c.max_ngram, c.min_ngram)
        for chain in chains:
            b.retrieved |= b.add_chain(chain, kind=lookup_kind(order, c.max_ngram), origin=src) > 0
        # keys for (root, guess): the last max_ngram - 1 context tokens, then the guess
        tail = list(context[len(context) - (c.max_ngram - 1):]) if c.max_ngram > 1 else []
        for rank, g in enumerate(guesses, 1):
            if b.full:
                break
            keep = c.keep_for_rank(rank)
            hits, _, src = (retrieve_with_order(sources, tail + [int(g)], keep - 1, 1, c.max_ngram,
                                                c.min_ngram)
                            if keep > 1 else ([], 0, -1))
            added = b.add_chain([int(g)] + (hits[0] if hits else []), kind=guess_kind(rank), origin=src,
                                first_origin=GUESS)
            b.retrieved |= bool(hits) and added > 0
        return b.build()


class RestDrafter(Drafter):
    """REST (:mod:`logitspec.rest`): the trie of the continuations of the longest context suffix found
    in the datastore, its most frequent nodes first. The datastore is the first of the row's sources
    that is a :class:`~logitspec.rest.Datastore` (its reference); a row without one uses its own
    context as the datastore (REST itself has no such mode: this keeps ``--method rest`` usable
    without a corpus, as prompt lookup over suffixes of up to 16 tokens)."""

    def base_budget(self) -> int:
        return self.config.rest_num_draft

    def draft(self, sources, context, guesses, budget, state=None):
        from . import rest  # here, not at the top: `python -m logitspec.rest` must find it not yet imported

        c = self.config
        store, origin = next(((s, i) for i, s in enumerate(sources) if isinstance(s, rest.Datastore)),
                             (None, 0))
        toks, parents, depths, span = rest.retrieve(store, context, min(budget, c.rest_num_draft),
                                                    c.rest_max_span, c.rest_min_span, c.rest_continuation,
                                                    c.rest_max_matches)
        n = len(toks)
        if not n:
            return DraftTree.single(context[-1])
        kind = lookup_kind(span, c.max_ngram)
        return DraftTree(np.concatenate(([int(context[-1])], toks)), np.concatenate(([-1], parents + 1)),
                         retrieved=True, kinds=np.array([0] + [kind] * n, dtype=np.int64),
                         offsets=np.concatenate(([0], depths - 1)),
                         origins=np.array([GUESS] + [origin] * n, dtype=np.int64))


def make_drafter(config: SpecConfig) -> Drafter:
    if config.method == "lookahead":
        from .lookahead import LookaheadDrafter  # here: lookahead imports this module

        return LookaheadDrafter(config)
    return {"ar": Drafter, "pld": PromptLookupDrafter, "logitspec": LogitSpecDrafter,
            "rest": RestDrafter}[config.method](config)
