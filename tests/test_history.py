"""The history draft source: finds continuations once fed, stays within its token budget, and
leaves greedy output equal to ``ar``."""
import pytest
from tiny_models import repetitive_prompts, tiny_model

from logitspec import Engine, SpecConfig
from logitspec.spec_decode.history import HistorySource
from logitspec.spec_decode.ngram_index import retrieve


def test_finds_continuations_after_being_fed_newest_first():
    h = HistorySource(max_tokens=100)
    assert h.lookup([1, 2], 3) == []
    h.add([1, 2, 3, 4, 5])
    h.add([9, 1, 2, 7, 8])
    assert h.lookup([1, 2], 3) == [[7, 8]]  # the newest answer first
    assert h.lookup([1, 2], 3, max_results=2) == [[7, 8], [3, 4, 5]]
    # consulted after the row's own context: the own context wins at the same n-gram length
    own = retrieve([_Fixed({(1, 2): [[6]]}), h], [0, 1, 2], 3, max_ngram=2)
    assert own == [[6]] and retrieve([_Fixed({}), h], [0, 1, 2], 3, max_ngram=2) == [[7, 8]]


def test_memory_bound_drops_the_oldest_answers():
    h = HistorySource(max_tokens=10)
    for i in range(5):
        h.add([100 + i, 1, 2, 3])
        assert h.tokens <= 10
    assert h.tokens == 8 and len(h.answers) == 2
    assert h.lookup([103], 2) == [[1, 2]] and h.lookup([102], 2) == []  # 102's answer was dropped
    with pytest.raises(ValueError):
        HistorySource(max_tokens=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_with_history_equals_ar(family):
    model = tiny_model(family)
    prompts = repetitive_prompts(6, seed=4)
    plain = Engine(model, None, SpecConfig(method="ar"))
    ar = [r.token_ids for r in plain.generate(prompts, max_new_tokens=16)]
    hist = HistorySource(max_tokens=200)
    eng = Engine(model, None, SpecConfig(method="logitspec", max_batch_size=2, budget="fixed"), history=hist)
    twice = eng.generate(prompts + prompts, max_new_tokens=16)
    assert [r.token_ids for r in twice] == ar + ar
    assert hist.tokens > 0
    # the second pass finds the first pass's answers: more tokens per forward
    mat = [sum(r.stats["mean_accepted"] for r in twice[i:i + 6]) for i in (0, 6)]
    assert mat[1] > mat[0]
    # every emitted draft token is attributed to one source; the second pass's come from history
    for r in twice:
        drafted = sum(r.stats["accepted_lengths"]) - r.stats["steps"]  # less one bonus token per forward
        assert drafted <= sum(r.stats["accepted_from"].values()) <= drafted + 1
        assert r.stats["accepted_from"]["reference"] == 0  # none given
    from_history = [sum(r.stats["accepted_from"]["history"] for r in twice[i:i + 6]) for i in (0, 6)]
    assert from_history[1] > from_history[0]


class _Fixed:
    max_ngram = 2

    def __init__(self, table):
        self.table = table

    def lookup(self, key, max_tokens, max_results=1):
        return self.table.get(tuple(key), [])[:max_results]
