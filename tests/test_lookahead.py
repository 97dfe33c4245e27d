"""Lookahead decoding's pure core (logitspec.lookahead) on hand-made integer tables: the n-gram pool,
the Jacobi window and its n-grams, the tree (its mask is LADE's 2D mask), and a table "model"."""

import numpy as np

from logitspec.lookahead import NgramPool, Window, build_tree, locate


def test_pool_keeps_the_most_recent_continuations_per_first_token():
    pool = NgramPool(n=3, size=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # again: most recent now
    assert pool.candidates(1) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # full: the least recently added (4, 5) goes
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    pool.add([1, 2])  # not an n-gram of n tokens
    assert pool.candidates(9) == [] and len(pool) == 2


def test_window_starts_from_prompt_tokens_and_warms_up_one_level_a_step():
    rng = np.random.default_rng(0)
    w = Window.start([10, 11, 12], w=3, n=4, rng=rng)
    assert len(w.levels) == 1 and len(w.levels[0]) == 3 + 4 - 3
    assert set(w.levels[0]) <= {10, 11, 12}
    w = Window([[1, 2, 3, 4]], n=4)
    assert w.size == 4 and not w.full
    assert w.advance(0, [21, 22, 23, 24]) == []  # outputs after the trunk's nodes become level 1
    assert w.levels == [[2, 3, 4], [21, 22, 23, 24]] and w.size == 3 + 4
    assert w.advance(0, [31, 32, 33, 34]) == []  # outputs after level 1: level 2, one column on
    assert w.levels == [[3, 4], [22, 23, 24], [32, 33, 34]] and w.full and w.size == 2 + 2 * 3


def test_full_window_yields_each_columns_ngram_and_moves_one_column():
    w = Window([[3, 4], [22, 23, 24], [32, 33, 34]], n=4)
    grams = w.advance(9, [41, 42, 43])  # root 9: column 0's trunk node
    assert grams == [(9, 22, 32, 41), (3, 23, 33, 42), (4, 24, 34, 43)]
    assert w.levels == [[23, 24], [32, 33, 34], [41, 42, 43]]  # LADE: past[0] = past[1][1:], ...


def _window_nodes(w):
    """(level, column) -> token of a window, the trunk as level 0 columns 1.. (column 0: the root)."""
    cells = {(0, j + 1): t for j, t in enumerate(w.levels[0])}
    cells.update({(lv, j): t for lv in range(1, len(w.levels)) for j, t in enumerate(w.levels[lv])})
    return cells


def test_window_tree_mask_is_lades_2d_mask_with_its_positions():
    """LADE (j_make_causal_mask_multilevel): a level-l token of column j sees the root, level 0 up to
    its column and the tokens above it in its column; it sits at position root + j + l."""
    w = Window([[1, 2, 3], [11, 12, 13, 14], [21, 22, 23, 24]], n=4)
    tree = build_tree(0, w, [], budget=100)
    assert len(tree) == 1 + w.size
    nodes = locate(tree, w)
    where = {(0, j + 1): n for j, n in enumerate(nodes[0])}
    where[(0, 0)] = 0
    where.update({(lv, j): n for lv in (1, 2) for j, n in enumerate(nodes[lv])})
    mask, depths = tree.ancestor_mask(), tree.depths
    for (lv, j), node in where.items():
        sees = {(0, c) for c in range(j + 1)} | {(l2, j) for l2 in range(1, lv + 1)}
        assert {cell for cell, other in where.items() if mask[node, other]} == sees, (lv, j)
        assert depths[node] == j + lv
    assert all(tree.tokens[where[c]] == t for c, t in _window_nodes(w).items())


def test_candidates_merge_with_the_window_and_the_window_is_kept_or_dropped_whole():
    w = Window([[1, 2], [11, 12, 13]], n=3)  # full: 2 + 3 nodes
    tree = build_tree(0, w, [(1, 2), (1, 5), (7, 8)], budget=100)
    assert len(tree) == 1 + 5 + 1 + 2  # (1, 2) is the trunk; (1, 5) adds 5; (7, 8) two nodes
    assert tree.retrieved and locate(tree, w) is not None
    small = build_tree(0, w, [(7, 8), (6, 5)], budget=4)  # the window (5) does not fit: dropped
    assert small.tokens.tolist() == [0, 7, 8, 6, 5] and locate(small, w) is None
    cut = build_tree(0, w, [(7, 8), (6, 5)], budget=6)  # the window, then one candidate node
    assert len(cut) == 7 and cut.tokens[-1] == 7
    assert not build_tree(0, w, [], budget=100).retrieved
