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
