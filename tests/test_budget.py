import numpy as np
import pytest

from logitspec.spec_decode.budget import (
    N_STREAK_STATES,
    AcceptanceStats,
    CostCurve,
    choose_size,
    choose_sizes,
    drain_weights,
    streak_state,
    top_nodes,
)
from logitspec.spec_decode.tree import DraftTree

TREE = DraftTree(np.array([7, 1, 2, 3, 4]), np.array([-1, 0, 1, 2, 0]),
                 kinds=np.array([0, 1, 1, 1, 2]), offsets=np.array([0, 0, 1, 2, 0]))


def test_node_probs_multiply_along_paths_and_learn():
    st = AcceptanceStats(n_kinds=3, max_offset=4, prior_hits=1, prior_misses=1)
    assert np.allclose(st.node_probs(TREE), [1, 0.5, 0.25, 0.125, 0.5])
    for _ in range(20):
        st.update(TREE, [0, 1, 2])  # branch 0 accepted twice, its 3rd node rejected; kind 2 rejected
    p = st.node_probs(TREE)
    assert p[1] > 0.9 and p[2] > 0.85 and p[3] < 0.1 and p[4] < 0.1


def test_update_counts_only_tested_nodes():
    st = AcceptanceStats(n_kinds=3, max_offset=4, prior_hits=0, prior_misses=1)
    st.update(TREE, [0, 4])  # node 1 tested and rejected; 2, 3 never tested
    assert st.tries[0, 1, 0] == 2 and st.hits[0, 1, 0] == 0
    assert st.tries[0, 1, 1] == 1 and st.tries[0, 2, 0] == 2 and st.hits[0, 2, 0] == 1


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve([1, 4, 8], [1.0, 1.6, 2.0])
    assert c(1) == 1.0 and np.isclose(c(2), 1.2) and np.isclose(c(6), 1.8) and np.isclose(c(12), 2.4)


def test_choose_size_trades_acceptance_for_cost():
    probs = [np.array([0.9, 0.8, 0.1, 0.05])]
    flat = CostCurve([1, 64], [1.0, 1.0])
    assert choose_size(probs, flat, 4) == 4
    steep = CostCurve([1, 2, 64], [1.0, 2.0, 64.0])
    assert choose_size(probs, steep, 4) == 0
    knee = CostCurve([1, 3, 4, 64], [1.0, 1.1, 2.0, 40.0])  # 2 drafts cheap, the 3rd costly
    assert choose_size(probs, knee, 4) == 2


def test_choose_size_shrinks_with_batch():
    c = CostCurve([1, 8, 16, 64], [1.0, 1.05, 1.6, 6.0])
    p = np.array([0.6, 0.3, 0.2, 0.1, 0.1, 0.1, 0.05])
    assert choose_size([p], c, 7) > choose_size([p] * 8, c, 7)


def test_top_nodes_is_ancestor_closed():
    probs = np.array([1, 0.6, 0.5, 0.1, 0.55])
    t = top_nodes(TREE, probs, 3)
    assert t.tokens.tolist() == [7, 1, 2, 4] and t.parents.tolist() == [-1, 0, 1, 0]


def test_states_learn_separately():
    st = AcceptanceStats(n_kinds=3, max_offset=4, prior_hits=1, prior_misses=1, n_states=2)
    for _ in range(20):
        st.update(TREE, [0, 1, 2, 3], state=1)  # after a hit: the whole chain accepted
        st.update(TREE, [0], state=0)  # after a miss: nothing accepted
    assert st.node_probs(TREE, state=1)[3] > 0.7
    assert st.node_probs(TREE, state=0)[1] < 0.1


def test_long_streaks_have_a_state_of_their_own():
    """A step after a whole copied chain was accepted is not pooled with one after 2 tokens."""
    assert [streak_state(n) for n in (0, 1, 2, 3, 4, 7, 8, 10)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert N_STREAK_STATES == 5
    chain = DraftTree(np.arange(11), np.arange(-1, 10), kinds=np.zeros(11, dtype=int),
                      offsets=np.r_[0, np.arange(10)])
    st = AcceptanceStats(n_kinds=1, max_offset=16, n_states=N_STREAK_STATES)
    for _ in range(30):
        st.update(chain, list(range(11)), state=streak_state(10))  # inside a copy: the whole chain
        st.update(chain, [0, 1, 2, 3], state=streak_state(2))  # after 2 tokens: 3, then a miss
    assert st.node_probs(chain, streak_state(10))[-1] > 0.3 > 0.01 > st.node_probs(chain, streak_state(3))[-1]


def test_priors_per_kind_and_per_state_and_kind():
    st = AcceptanceStats(n_kinds=2, max_offset=2, prior_hits=1, prior_misses=3, n_states=3,
                         kind_priors={(2, 0): (9.0, 1.0), 0: (3.0, 1.0)})
    chain = DraftTree(np.array([5, 6]), np.array([-1, 0]), kinds=np.array([0, 0]), offsets=np.array([0, 0]))
    guess = DraftTree(np.array([5, 6]), np.array([-1, 0]), kinds=np.array([0, 1]), offsets=np.array([0, 0]))
    assert st.node_probs(chain, 0)[1] == st.node_probs(chain, 1)[1] == 0.75  # the kind's, in every state
    assert st.node_probs(chain, 2)[1] == 0.9  # the state's own, whatever the order given
    assert st.node_probs(guess, 2)[1] == 0.25  # other kinds keep the default


def test_batch_curves_interpolate_in_rows():
    c = CostCurve([1, 8, 16], [1.0, 1.2, 1.6], batches={4: {"tokens": [1, 2], "seconds": [1.5, 2.0]},
                                                        "8": {"tokens": [1, 2], "seconds": [2.0, 3.0]}})
    assert c.step(1, 8) == c(8) and c.step(4, 2) == 2.0 and c.step(8, 1) == 2.0
    assert np.isclose(c.step(6, 1), 1.75) and np.isclose(c.step(2, 1), 1.0 + (1.5 - 1.0) / 3)
    assert np.isclose(c.step(16, 2), 6.0)  # beyond the largest batch: proportional
    assert CostCurve(**c.to_dict()).step(6, 2) == c.step(6, 2)
    assert CostCurve([1, 16], [1.0, 1.6]).step(8, 2) == CostCurve([1, 16], [1.0, 1.6])(16)


def test_choose_size_uses_the_batch_curve():
    probs = [np.array([0.5, 0.2])] * 8
    tokens_only = CostCurve([1, 8, 16, 24], [1.0, 1.2, 1.4, 1.6])
    assert choose_size(probs, tokens_only, 2) >= 1  # 16 tokens of one row look cheap
    batched = CostCurve(tokens_only.tokens, tokens_only.seconds,
                        batches={8: {"tokens": [1, 2, 3], "seconds": [1.2, 1.9, 2.6]}})
    assert choose_size(probs, batched, 2) == 0  # 8 rows x 2 tokens measured 1.58x 8 x 1: drafts do not pay


def _score(probs, cost, sizes):
    """Expected tokens per second of a per-row choice, as choose_sizes models it."""
    B, width = len(probs), 1 + max(sizes)
    gain = B + sum(p[:n].sum() for p, n in zip(probs, sizes))
    return gain / (cost.step(B, width) - cost.head_time(B * width) + cost.head_time(B + sum(sizes)))


def test_choose_sizes_without_a_head_curve_is_choose_size_for_every_row():
    c = CostCurve([1, 8, 16, 64], [1.0, 1.05, 1.6, 6.0],
                  batches={4: {"tokens": [1, 2, 3], "seconds": [1.2, 1.5, 2.1]}})
    probs = [np.array([0.9, 0.8, 0.7]), np.array([0.3, 0.1, 0.05]), np.array([0.6, 0.2, 0.1]),
             np.array([0.2, 0.1, 0.0])]
    n = choose_size(probs, c, 3)
    assert n >= 1 and choose_sizes(probs, c, 3) == [n] * 4


def test_copying_rows_get_nodes_and_the_rest_none():
    """At batch the padded decoder costs little more per token, the output layer a lot per node:
    only the rows whose drafts are good bets verify them."""
    head = {"tokens": [1, 64], "seconds": [0.02, 0.02 * 64]}  # 20 ms a node
    c = CostCurve([1, 64], [0.1, 2.0], batches={8: {"tokens": [1, 2, 3, 4], "seconds": [0.3, 0.5, 0.7, 0.9]}},
                  head=head)
    copying, poor = np.array([0.95, 0.9, 0.85]), np.array([0.1, 0.05, 0.02])
    probs = [copying, poor] * 4
    sizes = choose_sizes(probs, c, 3)
    assert sizes[::2] == [sizes[0]] * 4 and sizes[0] >= 2 and sizes[1::2] == [0] * 4
    uniform = choose_size(probs, c, 3)  # every row as many nodes: the poor rows' output layer wasted
    assert _score(probs, c, sizes) > _score(probs, c, [uniform]
                                            * 8) and _score(probs, c, sizes) > _score(probs, c, [0] * 8)


def test_choose_sizes_falls_back_to_plain_decoding_when_nothing_pays():
    head = {"tokens": [1, 64], "seconds": [0.01, 0.64]}
    c = CostCurve([1, 64], [0.1, 2.0], batches={8: {"tokens": [1, 2, 3], "seconds": [0.3, 0.6, 0.9]}},
                  head=head)
    probs = [np.array([0.9, 0.8, 0.7])] + [np.array([0.3, 0.1, 0.05])] * 7
    assert choose_sizes(probs, c, 3) == [0] * 8  # a width of 2 doubles the decoder for all 8 rows
    assert CostCurve(**c.to_dict()).head_time(32) == c.head_time(32) == pytest.approx(0.32)


@pytest.mark.parametrize("seed", range(5))
def test_choose_sizes_is_never_worse_than_plain_or_uniform(seed):
    rng = np.random.default_rng(seed)
    head = {"tokens": [1, 8, 64], "seconds": [0.02, 0.05, 0.3]}
    c = CostCurve([1, 8, 64], [0.08, 0.12, 0.7], batches={
        4: {"tokens": [1, 2, 3, 4], "seconds": [0.1, 0.15, 0.2, 0.25]},
        16: {"tokens": [1, 2, 3, 4], "seconds": [0.2, 0.35, 0.5, 0.65]}}, head=head)
    for B in (1, 4, 6, 16, 24):
        probs = [np.sort(np.cumprod(rng.uniform(0.0, 1.0, 4)))[::-1] for _ in range(B)]
        best = _score(probs, c, choose_sizes(probs, c, 4))
        assert all(best >= _score(probs, c, [n] * B) * (1 - 1e-9) for n in range(5))


def test_drain_weights_value_the_rows_that_set_the_batch_end():
    # steps left: 40 / 1 = 40, 30 / 1 = 30, 30 / 3 = 10, 10 / 1 = 10: row 0 alone sets the end
    w = drain_weights([40, 30, 30, 10], [1.0, 1.0, 3.0, 1.0], share=0.05, end=0.8)
    assert w.tolist() == [0.8, 0.05, 0.05, 0.05]
    # 40 and 38 tie (within 0.9): the end moves when both gain, each token a half of it
    w = drain_weights([40, 38, 30, 10], [1.0, 1.0, 3.0, 1.0], share=0.05)
    assert w.tolist() == [0.5, 0.5, 0.05, 0.05]
    # the cost of the last steps by how many rows run them
    w = drain_weights([5, 5, 1], [1.0, 1.0, 1.0], share=0.3, end=lambda k: 0.4 * k)
    assert w.tolist() == [0.4, 0.4, 0.3]
    # no rate yet: 1 a step
    assert drain_weights([9, 3], [float("nan"), 1.0], share=0.1).tolist() == [1.0, 0.1]


def test_a_static_batch_drafts_only_where_it_saves_time():
    """Draining, a plain step is worth one step of the batch: copying rows that tie for the end are
    worth their nodes (together they move it); a row that alone sets the end is, the rows ahead of it
    are not."""
    head = {"tokens": [1, 64], "seconds": [0.004, 0.004 * 64]}
    c = CostCurve([1, 64], [0.1, 2.0], batches={4: {"tokens": [1, 2, 3, 4], "seconds": [0.2, 0.24, 0.28,
                                                                                        0.32]}},
                  head=head)
    probs = [np.array([0.95, 0.9, 0.85]), np.array([0.9, 0.6, 0.3])] * 2
    tied = drain_weights([40] * 4, [1.0] * 4, share=0.05)
    assert choose_sizes(probs, c, 3) != [0] * 4  # as throughput (a job) they pay
    assert all(choose_sizes(probs, c, 3, weights=tied, base=1.0))  # ... and together they move the end
    alone = drain_weights([40, 20, 20, 20], [1.0] * 4, share=0.05, end=0.9)
    assert choose_sizes(probs, c, 3, weights=alone, base=1.0) == [3, 0, 0, 0]


def test_weighted_rows_draft_only_where_it_shortens_the_batch():
    """A row whose tokens are worth little (ahead in a draining batch) gets no nodes, even copying;
    the row that sets the end gets them."""
    head = {"tokens": [1, 64], "seconds": [0.004, 0.004 * 64]}
    c = CostCurve([1, 64], [0.1, 2.0], batches={4: {"tokens": [1, 2, 3, 4], "seconds": [0.2, 0.24, 0.28,
                                                                                        0.32]}},
                  head=head)
    copying = np.array([0.95, 0.9, 0.85])
    probs = [copying] * 4
    assert choose_sizes(probs, c, 3) == [3] * 4
    assert choose_sizes(probs, c, 3, weights=[1.0, 0.02, 0.02, 0.02]) == [3, 0, 0, 0]


def test_margin_refuses_drafts_that_barely_pay():
    c = CostCurve([1, 2, 64], [1.0, 1.2, 10.0])
    probs = [np.array([0.25])]  # 1.25 tokens for 1.2x the time: 4% better than plain
    assert choose_sizes(probs, c, 1) == [1]
    assert choose_sizes(probs, c, 1, margin=0.1) == [0]
    assert choose_sizes([np.array([0.9])], c, 1, margin=0.1) == [1]


def test_long_context_makes_each_node_dearer():
    """Beyond the columns the curve was measured at, each node of the forward costs per column read."""
    c = CostCurve([1, 2, 8, 64], [1.0, 1.05, 1.4, 6.0], context={"per_column": 1e-4, "columns": 256})
    assert c.step(1, 8, columns=100) == c.step(1, 8) == pytest.approx(1.4)
    assert c.step(1, 8, columns=2256) == pytest.approx(1.4 + 1e-4 * 8 * 2000)
    assert CostCurve(**c.to_dict()).step(2, 4, columns=1256) == pytest.approx(c.step(2, 4, columns=1256))
    probs = [np.array([0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05])]
    short, long = choose_sizes(probs, c, 7, columns=256)[0], choose_sizes(probs, c, 7, columns=8256)[0]
    assert short > long >= 1
