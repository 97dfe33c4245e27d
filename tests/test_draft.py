from logitspec.config import SpecConfig
from logitspec.spec_decode.drafters import LogitSpecDrafter, PromptLookupDrafter, make_drafter
from logitspec.spec_decode.ngram_index import SequenceIndex
from logitspec.spec_decode.tree import GUESS


def test_ar_drafts_nothing():
    d = make_drafter(SpecConfig(method="ar"))
    t = d.draft([SequenceIndex([1, 2])], [1, 2], [], budget=10)
    assert t.tokens.tolist() == [2] and not t.retrieved


def test_pld_single_chain_of_lookup():
    ctx = [1, 2, 3, 4, 5, 6, 1, 2]
    d = PromptLookupDrafter(SpecConfig(method="pld", pld_max_tokens=3))
    t = d.draft([SequenceIndex(ctx)], ctx, [], budget=10)
    assert t.tokens.tolist() == [2, 3, 4, 5] and t.parents.tolist() == [-1, 0, 1, 2] and t.retrieved
    assert d.draft([SequenceIndex(ctx)], ctx, [], budget=2).tokens.tolist() == [2, 3, 4]


def test_logitspec_branch0_plus_guess_branches_with_rank_pruning():
    # context ends in root 2; (1, 2) -> 3 4 5;  (2, 7) -> 8 9;  guess 6 has no retrieval
    ctx = [1, 2, 3, 4, 5, 2, 7, 8, 9, 0, 1, 2]
    cfg = SpecConfig(method="logitspec", capacity=10, branch0_max_tokens=3, rank_limits=(1,), rank_keep=(3,),
                     rank_keep_else=1)
    d = LogitSpecDrafter(cfg)
    t = d.draft([SequenceIndex(ctx)], ctx, guesses=[7, 6, 3], budget=10)
    toks, par = t.tokens.tolist(), t.parents.tolist()
    # branch 0: 3 4 5; guess 7 (rank 1 keeps 3 tokens): 7 8 9; guess 6 (keeps 1): 6;
    # guess 3 merges into branch 0
    assert toks == [2, 3, 4, 5, 7, 8, 9, 6]
    assert par == [-1, 0, 1, 2, 0, 4, 5, 0]
    assert t.retrieved
    assert t.origins.tolist() == [GUESS, 0, 0, 0, GUESS, 0, 0, GUESS]  # retrieved from source 0, or guessed


def test_origins_name_the_source_that_supplied_each_node():
    # the row's own context has nothing after (5, 2); the second source continues it, and (2, 7)
    ctx = [1, 5, 2]
    other = SequenceIndex([5, 2, 3, 4, 0, 2, 7, 8])
    cfg = SpecConfig(method="logitspec", capacity=10, branch0_max_tokens=2, rank_limits=(1,), rank_keep=(3,),
                     rank_keep_else=1)
    t = LogitSpecDrafter(cfg).draft([SequenceIndex(ctx), other], ctx, guesses=[7], budget=10)
    assert t.tokens.tolist() == [2, 3, 4, 7, 8] and t.origins.tolist() == [GUESS, 1, 1, GUESS, 1]
    pld_drafter = PromptLookupDrafter(SpecConfig(method="pld", pld_max_tokens=2))
    pld = pld_drafter.draft([SequenceIndex(ctx), other], ctx, [], 10)
    assert pld.origins.tolist() == [GUESS, 1, 1]


def test_logitspec_capacity_is_a_hard_limit():
    ctx = [1, 2, 3, 4, 5, 1, 2]
    d = LogitSpecDrafter(SpecConfig(method="logitspec", capacity=64))
    t = d.draft([SequenceIndex(ctx)], ctx, guesses=list(range(10, 40)), budget=4)
    assert len(t) - 1 == 4


def test_budget_scales_with_active_sequences():
    c = SpecConfig(capacity=16, budget_decay=1.0, min_capacity=2)
    assert [c.budget_for(16, a) for a in (1, 2, 4, 8, 16)] == [16, 8, 4, 2, 2]
    assert SpecConfig.paper().budget_for(64, 8) == 64


def _paths(tree) -> set[tuple[int, ...]]:
    """Every node's token path from the root (the root's token first)."""
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(len(toks)):
        path = [toks[i]]
        while par[i] >= 0:
            i = par[i]
            path.append(toks[i])
        out.append(tuple(reversed(path)))
    return set(out)


def test_logitspecs_tree_holds_plds_at_every_budget():
    """At the same budget N, LogitSpec's first chain (inserted before its guess branches, up to N tokens)
    holds PLD's chain, so its tree contains PLD's: on random contexts with repeats, N = 2 .. 64."""
    import random

    rng = random.Random(0)
    pld = PromptLookupDrafter(SpecConfig(method="pld"))
    ls = LogitSpecDrafter(SpecConfig(method="logitspec", capacity=64))
    checked = longer = 0
    for _ in range(300):
        base = [rng.randrange(20) for _ in range(rng.randrange(3, 12))]
        ctx = (base * rng.randrange(2, 5))[: rng.randrange(8, 40)] + [rng.randrange(20)]
        guesses = [rng.randrange(20) for _ in range(rng.randrange(0, 8))]
        for budget in (2, 8, 16, 32, 64):
            p = pld.draft([SequenceIndex(ctx)], ctx, [], budget)
            t = ls.draft([SequenceIndex(ctx)], ctx, guesses, budget)
            assert _paths(p) <= _paths(t), (ctx, guesses, budget)
            checked += len(p) > 1
            longer += max(len(q) for q in _paths(t)) > 11  # a first chain past pld's 10 tokens
    assert checked > 300 and longer > 0


def test_guess_order_context_puts_guesses_that_followed_the_root_first():
    """guess_order="context": a guess the context shows right after the root goes first (with its
    continuation), the others after it in logit order; "logits" keeps the logits' order."""
    ctx = [5, 6, 42, 43, 1, 9, 8, 3, 6, 7, 2, 6]  # the root 6 was followed by 42, then (latest) by 7
    sources = [SequenceIndex(ctx, 3, 1)]
    guesses = [11, 12, 42]  # 42 is the third guess by the logits
    for order, first in (("logits", 11), ("context", 42)):
        cfg = SpecConfig(method="logitspec", capacity=6, top_k=3, guess_order=order, max_ngram=2)
        tree = LogitSpecDrafter(cfg).draft(sources, ctx, guesses, 6)
        children = [int(tree.tokens[i]) for i in range(1, len(tree)) if tree.parents[i] == 0]
        guessed = [t for t in children if t in guesses]
        assert guessed[0] == first, (order, children)
    assert tree.child(tree.child(0, 42), 43) is not None  # the moved guess keeps its continuation


def test_capacity_bounds_every_budgeted_methods_tree_alike():
    """``capacity`` means the same for pld, rest and logitspec: a method verifies at most that many
    nodes a step, whatever its own maximum (pld's chain of 10, rest's 64-node trie); under it, its own
    maximum holds."""
    from logitspec.spec_decode.drafters import RestDrafter

    for method, own in (("pld", "pld_max_tokens"), ("rest", "rest_num_draft"), ("logitspec", "capacity")):
        cls = {"pld": PromptLookupDrafter, "rest": RestDrafter, "logitspec": LogitSpecDrafter}[method]
        assert cls(SpecConfig(method=method, capacity=8)).base_budget() == 8, method
        big = SpecConfig(method=method, capacity=64)
        assert cls(big).base_budget() == getattr(big, own), method
