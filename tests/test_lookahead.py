"""Lookahead decoding's pure core (logitspec.spec_decode.lookahead) on hand-made integer tables: the n-gram
pool,
the Jacobi window and its n-grams, the tree (its mask is LADE's 2D mask), and a table "model"."""
import numpy as np
import pytest

from logitspec.config import SpecConfig
from logitspec.sample.acceptance import greedy_accept
from logitspec.spec_decode.lookahead import LookaheadDrafter, NgramPool, Window, build_tree, locate


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


def _table_model(vocab, seed=0):
    """A deterministic "model": the next token is a function of the last two tokens."""
    table = np.random.default_rng(seed).integers(0, vocab, size=(vocab, vocab))
    return lambda a, b: int(table[a, b])


def _run(drafter, nxt, prompt, n_new):
    """Greedy decoding with the drafter and the table model; the output and tokens per step."""
    ctx, state, steps = list(prompt), drafter.new_state(prompt), []
    while len(ctx) - len(prompt) < n_new:
        tree = drafter.draft([], ctx, [], drafter.base_budget(), state)
        outputs = []  # the target's token after each node: its path's last two tokens
        for i in range(len(tree)):
            path = [int(tree.tokens[k]) for k in tree.path_to(i)]
            seq = ctx[:-1] + path
            outputs.append(nxt(seq[-2], seq[-1]))
        path, bonus = greedy_accept(tree, outputs)
        drafter.observe(state, tree, path, outputs)
        new = [int(tree.tokens[k]) for k in path[1:]] + [bonus]
        ctx += new
        steps.append(len(new))
    return ctx[len(prompt):len(prompt) + n_new], steps, state


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_table_model_output_equals_plain_greedy_and_lookahead_accepts(seed):
    nxt = _table_model(5, seed)
    prompt = [1, 2, 3, 4, 0, 1]
    plain = list(prompt)
    for _ in range(60):
        plain.append(nxt(plain[-2], plain[-1]))
    cfg = SpecConfig(method="lookahead", lookahead_window=4, lookahead_level=4, lookahead_guesses=3)
    out, steps, state = _run(LookaheadDrafter(cfg), nxt, prompt, 60)
    assert out == plain[len(prompt):]
    assert state.grams > 0 and len(state.pool) > 0
    assert len(steps) < 60 * 0.8, steps  # a 5-token table cycles: n-grams and the window are accepted


# ------------------------------------------------------------------------------ through the engine
def test_lookahead_sampling_emits_the_target_distribution():
    """Chi-square of the first three sampled tokens against the exact distribution, every decoding step
    verifying lookahead's tree (a small window) and its n-gram pool filled, before the first step, with
    each token's greedy continuation: the sampled walk follows pool drafts (accepted tokens are checked
    to occur), so the accept path is exercised, and the drafts, made from argmaxes only, never depend on
    the target's draws."""
    import torch
    from chi2 import chi2, chi2_limit
    from tiny_models import VOCAB, tiny_model

    from logitspec import Engine
    from logitspec.sample.params import SamplingParams
    from logitspec.sample.sampler import probs_from_logits
    from logitspec.spec_decode.lookahead import LookaheadDrafter

    model = tiny_model("llama")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    prompt = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:12].tolist()
    params = SamplingParams(0.8, top_p=0.95)
    with torch.no_grad():  # each token's greedy continuation of two tokens after the prompt
        first = model(torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1].argmax(-1).tolist()
        second = model(torch.tensor([prompt + [t, first[t]] for t in range(VOCAB)])).logits[:, -1].argmax(-1)
    continuations = [(t, first[t], int(second[t])) for t in range(VOCAB)]

    class FilledPool(LookaheadDrafter):
        def new_state(self, prompt):
            state = super().new_state(prompt)
            for ngram in continuations:
                state.pool.add(ngram)
            return state
    cells, rest_mass = {(): 1.0}, 0.0  # exact probabilities of the first 3 tokens (cells >= 1e-4)
    for _ in range(3):
        seqs = list(cells)
        with torch.no_grad():
            probs = probs_from_logits(model(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1],
                                      params).double()
        grown = {}
        for s, row in zip(seqs, probs):
            joint = cells[s] * row
            keep = joint >= 1e-4
            rest_mass += float(joint[~keep].sum())
            grown.update({s + (int(t),): float(joint[t]) for t in torch.nonzero(keep).squeeze(1)})
        cells = grown
    cells[()] = rest_mass
    n = 800
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SpecConfig(method="lookahead", max_batch_size=16, lookahead_window=4, lookahead_level=3,
                         lookahead_guesses=4)
        res = Engine(model, None, cfg, drafter=FilledPool(cfg)).generate(
            [prompt] * n, max_new_tokens=3, temperature=0.8, top_p=params.top_p,
            seed=list(range(1000, 1000 + n)))
    finally:
        torch.set_num_threads(before)
    keys = list(cells)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.bincount([index.get(tuple(r.token_ids), index[()]) for r in res], minlength=len(keys))
    stat, df = chi2(counts, np.array([cells[k] for k in keys]), n)
    assert stat < chi2_limit(df), (stat, df)
    assert all(r.stats["mean_tree_size"] > 1 for r in res)  # decoding steps verified windows
    accepted = sum(max(r.stats["accepted_lengths"][1:], default=1) > 1 for r in res)
    print(f"rows that accepted a draft token: {accepted} of {n}")
    assert accepted > n // 10, accepted  # the walk followed drafts: the accept path ran


def test_bench_runs_lookahead(tmp_path):
    """``lookahead`` (and a variant of its W, N, G) rows in ``logitspec bench``: lossless, recorded."""
    import torch
    from test_bench import _tiny_model, _tiny_questions

    from logitspec.bench import DEFAULT_METHODS, bench, parse_methods

    assert "lookahead" in [s.name for s in parse_methods(DEFAULT_METHODS)]
    small = "lookahead@lookahead_window=3@lookahead_level=3@lookahead_guesses=2"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = bench((_tiny_model(), None), _tiny_questions(), tmp_path / "out",
                        methods=f"lookahead,{small}", max_new_tokens=8, warmup_tokens=4, progress=False)
    finally:
        torch.set_num_threads(before)
    assert summary["methods"]["lookahead"]["lossless"] == 1.0 and summary["methods"][small]["lossless"] == 1.0
    assert summary["method_configs"][small]["config"]["lookahead_window"] == 3
