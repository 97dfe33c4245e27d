"""The batch-invariant decode attention kernel (logitspec/kernels/decode_attention.py)."""
import pytest
import torch
import torch.nn.functional as F

from logitspec.kernels import decode_attention, skinny

pytestmark = pytest.mark.skipif(not skinny.available(), reason="the CPU kernels cannot be built here")

HIDE = torch.finfo(torch.float32).min


def _inputs(B, H, KV, D, S, T, seed=0, room=7):
    g = torch.Generator().manual_seed(seed)
    # views of a buffer with spare room, as the cache's
    k = torch.randn(B, KV, S + room, D, generator=g)[:, :, :S]
    v = torch.randn(B, KV, S + room, D, generator=g)[:, :, :S]
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # [B, H, T, D], as transformers passes it
    vis = torch.rand(B, 1, T, S, generator=g) > 0.4
    vis[..., -1] = True
    return q, k, v, vis


@pytest.mark.parametrize("B,H,KV,D,S,T", [(3, 4, 1, 256, 50, 1), (2, 4, 1, 256, 300, 6),
                                          (2, 14, 2, 64, 77, 3), (1, 8, 8, 32, 9, 2)])
def test_matches_sdpa_for_float_and_bool_masks(B, H, KV, D, S, T):
    q, k, v, vis = _inputs(B, H, KV, D, S, T)
    mask = torch.zeros(B, 1, T, S).masked_fill_(~vis, HIDE)
    G = H // KV
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                          attn_mask=mask, scale=0.1).transpose(1, 2)  # [B, T, H, D]
    got = decode_attention.attention(q, k, v, mask, 0.1)
    assert got.shape == (B, T, H, D) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(decode_attention.attention(q, k, v, vis, 0.1), got)


def test_tree_node_equals_the_same_token_decoded_alone():
    """A node at depth t of a verified chain (its row holding holes before the step's nodes) gets
    bitwise the output of one query after its ancestors were committed, and other rows of the batch
    do not change it. P and the holes put the tree's columns in another of the kernel's 64-column
    value blocks than the lone decode's: the sums run on across blocks unchanged."""
    H, KV, D, P, holes, T = 4, 1, 256, 137, 11, 5
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(P + T, D, generator=g)  # the row's committed columns, then the chain's nodes
    vals = torch.randn(P + T, D, generator=g)
    qs = torch.randn(T, H, D, generator=g)
    # the verification step: 3 rows, row 1 is ours; its cache has P columns then holes, then T nodes
    S = P + holes + T
    k = torch.randn(3, KV, S, D, generator=g)
    v = torch.randn(3, KV, S, D, generator=g)
    k[1, 0, :P], v[1, 0, :P] = keys[:P], vals[:P]
    k[1, 0, P + holes:], v[1, 0, P + holes:] = keys[P:], vals[P:]
    vis = torch.zeros(3, 1, T, S, dtype=torch.bool)
    vis[:, :, :, :P] = True
    vis[:, 0, :, P + holes:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    q = torch.randn(3, H, T, D, generator=g)
    q[1] = qs.transpose(0, 1)
    mask = torch.zeros(3, 1, T, S).masked_fill_(~vis, HIDE)
    tree = decode_attention.attention(q, k, v, mask, 0.0625)[1]  # [T, H, D]
    for t in range(T):  # decoded alone: the committed columns and its t ancestors, then itself
        n = P + t + 1
        alone = decode_attention.attention(qs[t][None, :, None], keys[None, None, :n], vals[None, None, :n],
                                           torch.zeros(1, 1, 1, n), 0.0625)[0, 0]
        assert torch.equal(tree[t], alone), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_rows_in_a_wide_batch_equal_themselves_alone(dtype):
    """A static batch's buffer is as wide as its longest row: a short row's padding (here NaN, as
    unwritten memory may be) never enters its result, which is bitwise the row's alone. bfloat16
    (with the additive mask a bfloat16 model gets) is the float32 result of its widened inputs."""
    H, KV, D, T = 4, 1, 256, 1
    lengths = [3, 70, 200, 9]
    S = max(lengths) + 1  # committed columns, then the step's node in the last column
    g = torch.Generator().manual_seed(5)
    k = torch.full((len(lengths), KV, S, D), float("nan"))
    v = torch.full((len(lengths), KV, S, D), float("nan"))
    vis = torch.zeros(len(lengths), 1, T, S, dtype=torch.bool)
    for b, n in enumerate(lengths):
        k[b, :, :n], v[b, :, :n] = torch.randn(KV, n, D, generator=g), torch.randn(KV, n, D, generator=g)
        k[b, :, -1], v[b, :, -1] = torch.randn(KV, D, generator=g), torch.randn(KV, D, generator=g)
        vis[b, :, :, :n] = True
        vis[b, :, :, -1] = True
    q = torch.randn(len(lengths), H, T, D, generator=g)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if dtype == torch.float32:
        mask = vis
    else:
        mask = torch.zeros(vis.shape, dtype=dtype).masked_fill(~vis, torch.finfo(dtype).min)
    assert decode_attention.applies(q, k, mask)
    batch = decode_attention.attention(q, k, v, mask, 0.0625)  # [B, T, H, D]
    assert not batch.isnan().any() and batch.dtype == dtype
    if dtype != torch.float32:
        wide = decode_attention.attention(q.float(), k.float(), v.float(), vis, 0.0625)
        assert torch.equal(batch, wide.to(dtype))
    for b, n in enumerate(lengths):
        cols = list(range(n)) + [S - 1]
        alone = decode_attention.attention(q[b:b + 1], k[b:b + 1, :, cols], v[b:b + 1, :, cols],
                                           torch.ones(1, 1, T, n + 1, dtype=torch.bool), 0.0625)
        assert torch.equal(batch[b:b + 1], alone), b


def test_applies_only_where_it_can_run():
    q, k, v, vis = _inputs(1, 4, 1, 256, 10, 2)
    assert decode_attention.applies(q, k, vis)
    assert not decode_attention.applies(q, k, None)
    assert not decode_attention.applies(q.double(), k.double(), vis)
    assert decode_attention.applies(q.bfloat16(), k.bfloat16(), vis)
    assert not decode_attention.applies(q.bfloat16(), k, vis)  # mixed dtypes
    q80, k80, _, vis80 = _inputs(1, 4, 1, 256, 100, decode_attention.MAX_QUERIES + 1)
    assert not decode_attention.applies(q80, k80, vis80)
    q48, k48, _, vis48 = _inputs(1, 2, 1, 48, 10, 1)  # D not a multiple of 32
    assert not decode_attention.applies(q48, k48, vis48)
    # a tensor-parallel rank holding none of the heads (Gemma 3's single key head under AutoTP)
    assert not decode_attention.applies(torch.zeros(1, 0, 2, 256), torch.zeros(1, 0, 10, 256), vis)
