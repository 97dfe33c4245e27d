"""Drafters: turn a sequence's context (+ the last logits' guesses) into a draft tree, one per method
(:func:`make_drafter`). The node kinds and the :class:`~logitspec.spec_decode.interface.Drafter` interface
they share
are in :mod:`logitspec.spec_decode.interface`.
"""
from __future__ import annotations

import numpy as np

from logitspec.config import SpecConfig
from logitspec.spec_decode.interface import Drafter, guess_kind, lookup_kind
from logitspec.spec_decode.lookahead import LookaheadDrafter
from logitspec.spec_decode.ngram_index import retrieve_with_order
from logitspec.spec_decode.tree import GUESS, DraftTree, TreeBuilder


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: one chain continuing the longest matching suffix n-gram."""

    def base_budget(self) -> int:
        """Its chain's longest, within the capacity every budgeted method shares."""
        return min(self.config.pld_max_tokens, self.config.capacity)

    def draft(self, sources, context, guesses, budget, state=None):
        c = self.config
        b = TreeBuilder(context[-1], budget)
        hits, order, src = retrieve_with_order(sources, context, min(budget, c.pld_max_tokens), 1,
                                               c.max_ngram, c.min_ngram)
        if hits:  # its nodes learn acceptance by match length, as logitspec's first chain
            b.retrieved = b.add_chain(hits[0], kind=lookup_kind(order, c.max_ngram), origin=src) > 0
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
        # the first chain, up to the budget (or branch0_max_tokens): it holds what pld would draft
        chains, order, src = retrieve_with_order(sources, context, c.branch0_max_tokens or budget,
                                                 c.continuations_per_key, c.max_ngram, c.min_ngram)
        for chain in chains:
            b.retrieved |= b.add_chain(chain, kind=lookup_kind(order, c.max_ngram), origin=src) > 0
        # keys for (root, guess): the last max_ngram - 1 context tokens, then the guess
        tail = list(context[len(context) - (c.max_ngram - 1):]) if c.max_ngram > 1 else []
        ranked = list(enumerate(guesses, 1))
        found = {}  # guess -> its (root, guess) retrieval, of the longest branch any place keeps
        if c.guess_order == "context":  # guesses that followed the root in the context first
            pair = min(2, len(tail) + 1)  # the n-gram (root, guess) at least
            longest = max(1, max((*c.rank_keep, c.rank_keep_else)) - 1)
            for _, g in ranked:
                found[int(g)] = retrieve_with_order(sources, tail + [int(g)], longest, 1, c.max_ngram,
                                                    c.min_ngram)
            ranked.sort(key=lambda rg: not (found[int(rg[1])][0] and found[int(rg[1])][1] >= pair))
        for place, (rank, g) in enumerate(ranked, 1):
            if b.full:
                break
            keep = c.keep_for_rank(place)
            hits, _, src = [], 0, -1
            if keep > 1:
                hits, _, src = found.get(int(g)) or retrieve_with_order(sources, tail + [int(g)], keep - 1, 1,
                                                                        c.max_ngram, c.min_ngram)
                hits = [h[:keep - 1] for h in hits]  # a retrieval's prefix is the shorter retrieval
            added = b.add_chain([int(g)] + (hits[0] if hits else []), kind=guess_kind(rank), origin=src,
                                first_origin=GUESS)
            b.retrieved |= bool(hits) and added > 0
        return b.build()


class RestDrafter(Drafter):
    """REST (:mod:`logitspec.spec_decode.rest`): the trie of the continuations of the longest context suffix
    found
    in the datastore, its most frequent nodes first. The datastore is the first of the row's sources
    that is a :class:`~logitspec.spec_decode.rest.Datastore` (its reference); a row without one uses its own
    context as the datastore (REST itself has no such mode: this keeps ``--method rest`` usable
    without a corpus, as prompt lookup over suffixes of up to 16 tokens)."""

    def base_budget(self) -> int:
        """Its trie's size, within the capacity every budgeted method shares."""
        return min(self.config.rest_num_draft, self.config.capacity)

    def draft(self, sources, context, guesses, budget, state=None):
        # here, not at the top: `python -m logitspec.spec_decode.rest` must find it not yet imported
        from logitspec.spec_decode import rest

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


def drafter_class(method: str) -> type[Drafter]:
    """The drafter class of ``method`` (its class attributes say what it needs of a step)."""
    return {"ar": Drafter, "pld": PromptLookupDrafter, "logitspec": LogitSpecDrafter,
            "rest": RestDrafter, "lookahead": LookaheadDrafter}[method]


def make_drafter(config: SpecConfig) -> Drafter:
    return drafter_class(config.method)(config)
