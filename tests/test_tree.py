import numpy as np
import pytest

from logitspec.spec_decode.tree import DraftTree, TreeBuilder


def test_builder_merges_shared_prefixes_and_respects_capacity():
    b = TreeBuilder(root_token=7, capacity=5)
    assert b.add_chain([1, 2, 3]) == 3
    assert b.add_chain([1, 2, 4]) == 1  # shares 1,2
    assert b.add_chain([5, 6, 8]) == 1  # only one node left
    assert b.full
    t = b.build()
    assert t.tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert t.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    assert t.depths.tolist() == [0, 1, 2, 3, 3, 1]


def test_ancestor_mask_paths_and_children():
    t = DraftTree(np.array([7, 1, 2, 3, 4, 5]), np.array([-1, 0, 1, 2, 2, 0]))
    m = t.ancestor_mask()
    assert m[3].tolist() == [True, True, True, True, False, False]
    assert m[4].tolist() == [True, True, True, False, True, False]
    assert m[5].tolist() == [True, False, False, False, False, True]
    assert [t.path_to(i) for i in (3, 4, 5)] == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5]]
    assert t.child(2, 4) == 4 and t.child(2, 9) is None and t.child(0, 5) == 5


def test_rejects_non_topological_parents():
    with pytest.raises(ValueError):
        DraftTree(np.array([1, 2, 3]), np.array([-1, 2, 0]))
