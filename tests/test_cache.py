"""Cache surgery per attention-layer kind: keeping a tree's accepted path must give the same
logits as decoding that path plainly (guards against transformers cache changes)."""
import numpy as np
import pytest
import torch
from tiny_models import VOCAB, tiny_model

from logitspec.spec_decode.tree import DraftTree
from logitspec.worker.eager_runner import EagerRunner
from logitspec.worker.kv_cache import BatchKV, _cache_of
from logitspec.worker.masks import StepRow, layer_windows, pack


def _forward(model, rows, kv):
    p = pack(rows, kv.columns, layer_windows(model.config), torch.float32)
    out = model(input_ids=p.ids, position_ids=p.pos, attention_mask=p.mask, cache=kv.hf, use_cache=True)
    return out.logits


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: full + sliding (window 6) layers
def test_commit_keeps_only_the_accepted_path(family):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 4)]
    tree = DraftTree(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, 1, 0, 3]))  # paths 5-6-7 and 5-8-9
    accept = [[0, 3, 4], [0, 1]]
    with torch.no_grad():
        kv = BatchKV()
        for p in prompts:  # prefill each row on its own, then batch the rows (holes in row 1)
            row = BatchKV.empty_row()
            _forward(model, [StepRow.chain(0, p)], row)
            row.commit([list(range(len(p)))])
            kv.add_row(row)
        cols = kv.columns
        _forward(model, [StepRow.from_tree(len(p), tree) for p in prompts], kv)
        kv.commit([[cols + n for n in a] for a in accept])
        # one more token after the accepted paths, through the surgically edited cache
        nxt = [StepRow.chain(len(p) + len(a), [3]) for p, a in zip(prompts, accept)]
        got = _forward(model, nxt, kv)[:, 0]
        for b, (p, a) in enumerate(zip(prompts, accept)):
            full = p + [int(tree.tokens[n]) for n in a] + [3]
            want = model(torch.tensor([full])).logits[0, -1]
            assert torch.allclose(got[b], want, atol=1e-4), (got[b] - want).abs().max()
    assert kv.lengths == [len(p) + len(a) for p, a in zip(prompts, accept)]


def test_wrong_gather_is_detected():
    """The check above is sensitive: keeping the wrong branch changes the logits."""
    model = tiny_model("gemma3")
    p = list(range(1, 12))
    tree = DraftTree(np.array([5, 6, 8]), np.array([-1, 0, 0]))
    with torch.no_grad():
        kv = BatchKV.empty_row()
        _forward(model, [StepRow.chain(0, p)], kv)
        kv.commit([list(range(len(p)))])
        cols = kv.columns
        _forward(model, [StepRow.from_tree(len(p), tree)], kv)
        kv.commit([[cols + 0, cols + 2]])  # keeps 5, 8 ...
        got = _forward(model, [StepRow.chain(len(p) + 2, [3])], kv)[0, 0]
        want = model(torch.tensor([p + [5, 6, 3]])).logits[0, -1]  # ... but the truth is 5, 6
    assert (got - want).abs().max() > 1e-3


def test_keep_rows_releases_memory():
    model = tiny_model("llama")
    with torch.no_grad():
        kv = BatchKV()
        for n in (30, 5):
            row = BatchKV.empty_row()
            _forward(model, [StepRow.chain(0, list(range(1, n + 1)))], row)
            row.commit([list(range(n))])
            kv.add_row(row)
        assert kv.columns == 30
        kv.keep_rows([1])
    assert kv.lengths == [5] and kv.columns == 5
    # half free: a buffer of its own
    assert kv.hf.layers[0].keys.shape[0] == 1 and kv.hf.layers[0]._k.shape[0] == 1


def test_keep_rows_moves_the_last_rows_into_freed_slots():
    """A finished row's slot takes a row from the end (only its columns are copied); every kept row
    keeps its own columns and length, in the order returned."""
    g = torch.Generator().manual_seed(0)
    kv = BatchKV()
    rows = []
    for n in (4, 6, 3, 5, 2):
        row = BatchKV.empty_row()
        k, v = torch.randn(1, 1, n, 8, generator=g), torch.randn(1, 1, n, 8, generator=g)
        row.hf.update(k, v, 0)
        row.lengths = [n]
        kv.add_row(row)
        rows.append((k, v))
    buffer = kv.hf.layers[0]._k
    order = kv.keep_rows([0, 2, 3, 4])  # row 1 finished: row 4 moves into its slot
    assert order == [0, 4, 2, 3]
    assert kv.lengths == [4, 2, 3, 5] and kv.hf.layers[0]._k.data_ptr() == buffer.data_ptr()  # same buffer
    for new, old in enumerate(order):
        n = kv.lengths[new]
        assert torch.equal(kv.hf.layers[0].keys[new, :, :n], rows[old][0][0])
        assert torch.equal(kv.hf.layers[0].values[new, :, :n], rows[old][1][0])


def test_growing_layer_appends_in_place_and_matches_concatenation():
    from logitspec.worker.kv_cache import GrowingLayer

    g = torch.Generator().manual_seed(0)
    layer, ref_k, ref_v = GrowingLayer(), [], []
    for step, T in enumerate([5, 1, 3, 70, 1, 2, 130]):  # crosses the spare room several times
        k, v = torch.randn(2, 1, T, 4, generator=g), torch.randn(2, 1, T, 4, generator=g)
        ref_k.append(k)
        ref_v.append(v)
        keys, values = layer.update(k, v, 0)
        assert torch.equal(keys, torch.cat(ref_k, dim=2)) and torch.equal(values, torch.cat(ref_v, dim=2))
        if step == 1:
            buffer = layer._k
        if step == 2:
            assert layer._k is buffer  # small steps write into the spare room, no new buffer
    assert layer.get_seq_length() == 212
    layer.truncate(7)
    k, v = torch.randn(2, 1, 2, 4, generator=g), torch.randn(2, 1, 2, 4, generator=g)
    keys, _ = layer.update(k, v, 0)
    assert torch.equal(keys, torch.cat([torch.cat(ref_k, dim=2)[:, :, :7], k], dim=2))
    layer.crop(-3)
    assert layer.get_seq_length() == 6


def test_add_rows_gathers_rows_of_several_caches_like_one_at_a_time():
    g = torch.Generator().manual_seed(1)

    def cache(lengths):  # random keys/values, rows holding ``lengths`` columns (holes past them)
        kv = BatchKV()
        width = max(lengths)
        layers = [(torch.randn(len(lengths), 2, width, 4, generator=g),
                   torch.randn(len(lengths), 2, width, 4, generator=g)) for _ in range(3)]
        kv.hf, kv.lengths = _cache_of(layers), list(lengths)
        return kv

    group, single, base = cache([3, 7, 5]), cache([9]), cache([4, 6])
    sources = [(group, 2, 2), (group, 0, 1), (single, 0, 1), (group, 1, 3)]
    together, apart = cache([4, 6]), cache([4, 6])
    for layer_a, layer_b in zip(together.hf.layers, base.hf.layers):  # the same starting rows
        layer_a.set(layer_b.keys, layer_b.values)
    for layer_a, layer_b in zip(apart.hf.layers, base.hf.layers):
        layer_a.set(layer_b.keys, layer_b.values)
    together.add_rows(sources)
    for src, r, copies in sources:
        apart.add_row(src.row_prefix(r, src.lengths[r]), copies=copies)
    assert together.lengths == apart.lengths == [4, 6, 5, 5, 3, 9, 7, 7, 7]
    for a, b in zip(together.hf.layers, apart.hf.layers):
        for row, n in enumerate(together.lengths):  # committed columns equal; holes may differ
            assert torch.equal(a.keys[row, :, :n], b.keys[row, :, :n])
            assert torch.equal(a.values[row, :, :n], b.values[row, :, :n])


def test_rows_admitted_into_spare_rows_are_written_in_place():
    """With ``max_rows``, a cache keeps room for its slots: after rows finish, rows added later go
    into the freed rows of the same buffer (no copy of the held rows), longer rows widen it with
    zeroed holes, and every row keeps its own columns; past the room a new buffer is made."""
    g = torch.Generator().manual_seed(2)

    def row(n):
        r = BatchKV.empty_row()
        k, v = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
        r.hf.update(k, v, 0)
        r.lengths = [n]
        return r, k[0], v[0]

    kv = BatchKV(max_rows=4)
    made = [row(n) for n in (5, 3, 6)]
    kv.add_rows([(r, 0, 1) for r, _, _ in made])
    buffer = kv.hf.layers[0]._K
    assert buffer.shape[0] == 4 and kv.rows == 3
    order = kv.keep_rows([0, 2])  # row 1 finished: row 2 moves into its slot
    later = [row(9), row(2)]
    kv.add_rows([(r, 0, 1) for r, _, _ in later])
    layer = kv.hf.layers[0]
    assert layer._K is buffer and kv.rows == 4  # in place: the same buffer
    want = [made[o] for o in order] + later
    assert kv.lengths == [5, 6, 9, 2] and kv.columns == 9
    for b, (_, k, v) in enumerate(want):
        n = kv.lengths[b]
        assert torch.equal(layer.keys[b, :, :n], k) and torch.equal(layer.values[b, :, :n], v)
        assert not layer.keys[b, :, n:].any() and not layer.values[b, :, n:].any()  # holes are zero
    kv.add_row(row(4)[0])  # a fifth row: no room left, a new buffer holding all five
    assert kv.hf.layers[0]._K is not buffer and kv.rows == 5
    assert torch.equal(kv.hf.layers[0].keys[2, :, :9], later[0][1])


def test_split_row_gives_each_sequence_its_own_row():
    kv = BatchKV.empty_row()
    layer_kv = [(torch.arange(2 * 9 * 3, dtype=torch.float32).view(1, 2, 9, 3),) * 2 for _ in range(2)]
    kv.hf = _cache_of(layer_kv)
    kv.lengths = [9]
    rows = kv.split_row([4, 2, 3])
    assert rows.lengths == [4, 2, 3] and rows.columns == 4
    for layer in rows.hf.layers:
        full = layer_kv[0][0][0]  # [heads, 9, dim]
        assert torch.equal(layer.keys[0], full[:, 0:4])
        assert torch.equal(layer.keys[1, :, :2], full[:, 4:6])
        assert not layer.keys[1, :, 2:].any()  # holes zeroed
        assert torch.equal(layer.values[2, :, :3], full[:, 6:9])


def test_prompts_side_by_side_restart_positions_and_see_only_themselves():
    row = StepRow.side_by_side([[5, 6, 7], [8, 9]])
    assert row.tokens.tolist() == [5, 6, 7, 8, 9] and row.depths.tolist() == [0, 1, 2, 0, 1]
    assert row.parents.tolist() == [-1, 0, 1, -1, 3]
    assert row.visible[4].tolist() == [False, False, False, True, True]
    assert row.visible[2].tolist() == [True, True, True, False, False]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_side_by_side_equals_prefill_alone(family):
    """Each prompt's KV and last-token logits from a ragged prefill equal its own prefill's (the
    forward differs only in rows, so up to float32 summation order)."""
    from logitspec.sample.node_logits import OutputMode
    from logitspec.worker.eager_runner import EagerRunner

    model = tiny_model(family)
    target = EagerRunner(model)
    prompts = [[3, 9, 4, 1, 7, 7, 2], [5, 8], [11, 2, 6, 6, 1, 9, 4, 3, 8, 8, 2]]  # gemma3 window 6 < 11
    with torch.inference_mode():
        rows, lasts = target.prefill_rows(prompts, OutputMode.EXACT)
        for b, p in enumerate(prompts):
            alone, last = target.prefill(p, chunk=len(p), mode=OutputMode.EXACT)
            torch.testing.assert_close(lasts[b].scores, last.scores, rtol=1e-5, atol=1e-5)
            for mine, ref in zip(rows.hf.layers, alone.hf.layers):
                n = len(p)
                torch.testing.assert_close(mine.keys[b, :, :n], ref.keys[0, :, :n], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(mine.values[b, :, :n], ref.values[0, :, :n], rtol=1e-5, atol=1e-5)


def test_a_reserved_row_grows_its_buffers_once_over_a_chunked_prefill():
    target = EagerRunner(tiny_model("llama"))
    tokens = [(5 * i + 2) % VOCAB for i in range(200)]
    reserved, plain = BatchKV.empty_row(reserve=len(tokens)), BatchKV.empty_row()
    buffers = {"reserved": set(), "plain": set()}
    for start in range(0, len(tokens), 16):
        for name, row in (("reserved", reserved), ("plain", plain)):
            target.extend(row, tokens[start:start + 16])
            buffers[name].add(row.hf.layers[0]._k.data_ptr())
    assert len(buffers["reserved"]) == 1 and len(buffers["plain"]) > 1  # the plain row re-copied as it grew
    assert reserved.lengths == plain.lengths == [200]
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(reserved.hf.layers, plain.hf.layers))
