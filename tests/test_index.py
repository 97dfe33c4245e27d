import numpy as np

from logitspec.spec_decode.ngram_index import CorpusIndex, SequenceIndex, SiblingSource, retrieve


def test_sequence_index_most_recent_continuation_first():
    idx = SequenceIndex([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    # key (1, 2) occurs ending at 1, 5, 9; 9 is the current end (no continuation)
    assert idx.lookup([1, 2], max_tokens=3, max_results=2) == [[4, 5, 1], [3, 9, 1]]
    assert idx.lookup([2], max_tokens=1, max_results=5) == [[4], [3]]
    assert idx.lookup([7], 3) == []


def test_sequence_index_is_incremental():
    idx = SequenceIndex([5, 6], max_ngram=2)
    assert idx.lookup([5], 2) == [[6]]
    idx.extend([7, 5, 8])
    assert idx.lookup([5], 2) == [[8]]
    assert idx.lookup([5], 2, max_results=2) == [[8], [6, 7]]
    assert idx.lookup([6, 7], 3) == [[5, 8]]


def test_retrieve_prefers_longest_ngram():
    idx = SequenceIndex([1, 2, 3, 10, 0, 2, 3, 20, 1, 2, 3])
    # suffix (1,2,3) matched by the 3-gram -> 10; the 2-gram (2,3) would give 20 (more recent)
    assert retrieve([idx], [1, 2, 3], max_tokens=2) == [[10, 0]]
    assert retrieve([idx], [0, 2, 3], max_tokens=1) == [[20]]
    assert retrieve([idx], [42], max_tokens=1) == []


def test_retrieve_falls_back_to_reference_source():
    own = SequenceIndex([1, 2, 3])
    corpus = CorpusIndex.build([[7, 8, 9, 10], [3, 4, 5]])
    assert retrieve([own, corpus], [8], max_tokens=2) == [[9, 10]]
    # own context wins at equal n
    assert retrieve([own, corpus], [2], max_tokens=1) == [[3]]


def test_sibling_source_skips_its_own_answer_and_sees_later_siblings():
    group: list = []
    own, first = SequenceIndex([1, 2, 3, 4]), SequenceIndex([1, 2, 3, 7, 8])
    group += [first, own]
    near = SiblingSource(group, own)
    assert near.lookup([3], 2) == [[7, 8]]  # the sibling's continuation, not its own (4)
    group.append(SequenceIndex([3, 9, 3, 7, 5]))  # a sibling started later
    assert near.lookup([3], 2, max_results=3) == [[7, 8], [9, 3]]  # distinct first tokens ([7, 5] is not)
    assert near.lookup([42], 2) == []
    # consulted after the row's own context, at equal n
    assert retrieve([own, near], [3], max_tokens=1) == [[4]]
    assert retrieve([own, near], [2, 3, 7], max_tokens=1) == [[8]]


def test_corpus_index_lookup_and_document_boundaries():
    c = CorpusIndex.build([[1, 2, 3, 4], [2, 3, 9], [5, 1, 2]], max_ngram=3)
    assert sorted(c.lookup([2, 3], 2, max_results=3)) == [[4], [9]]
    assert c.lookup([1, 2, 3], 5) == [[4]]
    assert c.lookup([9], 3) == []  # 9 ends its document
    assert c.lookup([1, 2], 5) == [[3, 4]]  # the second (1,2) ends a document
    again = CorpusIndex.from_arrays(c.to_arrays())
    assert again.lookup([1, 2, 3], 5) == [[4]]
    assert isinstance(again.tokens, np.ndarray)
