"""flex attention on CUDA, checked by rule on CPU: every step shape the engine may build has a kernel
(inductor's flex decoding kernel accepts only a query block that is a multiple of its tile), and the
block lists the steps write (full blocks for the committed prefix, partial ones for the tree's tail)
give exactly the mask rule's attention when a kernel that reads them runs (inductor's CPU flex)."""
import inspect

import pytest
import torch

from logitspec.worker.gpu.step import (
    NODE_BUCKETS,
    Q_BLOCK,
    FlexMasks,
    StepBuffers,
    flex_kernel_options,
    visible,
)
from logitspec.worker.masks import StepRow

# query heads per key head of the families the engine serves: Llama 3 8B/70B (4, 8), Llama 2 7B (1),
# Qwen2/2.5 0.5B/7B (7), 32B (5), 72B (8), Gemma 3 270M/1B (4), 4B/12B/27B (2)
GROUPS = {"llama": (1, 4, 8), "qwen2": (7, 5, 8), "gemma3": (4, 2)}
# every node count a step can have: the buckets, and the exact sizes beyond them (oversize steps)
NODE_COUNTS = sorted(set(NODE_BUCKETS) | set(range(65, 130)))
MAIN_KERNEL_BLOCK_M = (64, 128)  # inductor's flex attention forward configurations' query tiles


def inductor_has_a_kernel(T: int, groups: int, q_block: int, options: dict) -> bool:
    """inductor's choice for a flex attention call of T queries (torch/_inductor/kernel/flex/): its
    decoding kernel for T < 128 and a power-of-two group count unless forced off, whose tile of
    max(16, next_pow2(T * groups)) rows must divide the query block; else its main kernel, whose
    64- or 128-row tiles must divide it."""
    decoding = T < 128 and groups & (groups - 1) == 0 and not options.get("FORCE_USE_FLEX_ATTENTION")
    if decoding:
        tile = max(16, 1 << (T * groups - 1).bit_length())
        return q_block % tile == 0
    return any(q_block % m == 0 for m in MAIN_KERNEL_BLOCK_M)


@pytest.mark.parametrize("family", sorted(GROUPS))
def test_every_step_shape_has_a_flex_kernel(family):
    bad = [(T, g) for g in GROUPS[family] for T in NODE_COUNTS
           if not inductor_has_a_kernel(T, g, Q_BLOCK, flex_kernel_options(T, g))]
    assert bad == []
    # the case that had no kernel: a Llama-3 model (4 groups) past 32 nodes, at the query block of 128
    assert not inductor_has_a_kernel(33, 4, 128, {})
    assert flex_kernel_options(32, 4) == {}  # within the tile: the decoding kernel stays


def test_the_rule_is_still_inductors():
    """The rule above is read from torch's source: fail loudly where a torch release changes it."""
    decoding = pytest.importorskip("torch._inductor.kernel.flex.flex_decoding")
    src = inspect.getsource(decoding)
    assert 'SPARSE_Q_BLOCK_SIZE % kernel_options["BLOCK_M"] != 0' in src
    assert "sympy.Lt(query.get_size()[-2], 128)" in src
    assert "FORCE_USE_FLEX_ATTENTION" in inspect.getsource(decoding._use_flex_decoding)


def _buffers(T=4, lengths=(37, 5, 90)):
    buf = StepBuffers(len(lengths) + 1, T, torch.device("cpu"))  # and a pad row
    rows = [StepRow.chain(L, list(range(1, 1 + min(n, T)))) for L, n in zip(lengths, (3, 1, T))]
    buf.fill(rows, list(lengths))
    return buf


def test_block_masks_use_the_query_block_and_full_blocks_for_the_prefix():
    buf = _buffers()
    flex = FlexMasks(buf, 128, {"full_attention": None, "sliding_attention": 20}, block=8)
    masks = flex.update()
    assert all(bm.BLOCK_SIZE == (Q_BLOCK, 8) for bm in masks.values())
    full = masks["full_attention"]
    # row 0 (37 committed, nodes at 37-40): blocks 0-3 whole, 4-5 partial; row 1 (5 committed, its node
    # and pads up to 8): blocks 0-1 partial; row 2 (90): 0-10 whole, 11 partial; the pad row: block 0
    assert full.full_kv_num_blocks.flatten().tolist() == [4, 0, 11, 0]
    assert full.kv_num_blocks.flatten().tolist() == [2, 2, 1, 1]
    assert full.kv_indices[0, 0, 0, :2].tolist() == [4, 5] and full.kv_indices[2, 0, 0, 0] == 11
    # sliding (20): every node of row 0 sees columns 21-36: block 3 whole; of row 2, 74-89: block 10
    # whole, its depth-0 node from 71 (block 8), its tail from 88 (block 11): 8, 9 and 11 partial
    sliding = masks["sliding_attention"]
    assert sliding.full_kv_num_blocks.flatten().tolist() == [1, 0, 1, 0]
    assert sliding.full_kv_indices[2, 0, 0, 0] == 10
    assert sliding.kv_num_blocks[2].item() == 3 and sliding.kv_indices[2, 0, 0, :3].tolist() == [8, 9, 11]


@pytest.mark.parametrize("T", [1, 4, 130])
def test_flex_with_the_block_lists_equals_the_mask_rule(T):
    """Inductor's CPU flex kernel reads the block lists (full blocks without the mask, partial ones
    with it, nothing else): for every real node its output equals SDPA under the dense mask rule, a
    step of more nodes than a query block (130: two) included. A control that drops the full blocks
    changes it (the kernel does read them)."""
    buf = _buffers(T)
    R, G, D, S = buf.R, 2, 8, -(-(90 + T) // 128) * 128
    flex = FlexMasks(buf, S, {"full_attention": None, "sliding_attention": 20}, block=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, h, n, D, generator=g) for h, n in ((4, T), (G, S), (G, S)))
    compiled = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    real = buf.depths >= 0  # [R, T]
    controlled = []
    for kind, bm in flex.update().items():
        seen = visible(buf, torch.arange(R)[:, None, None], buf.node[None, :, None],
                       torch.arange(S)[None, None, :], flex.windows[kind])  # [R, T, S]
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=seen[:, None])
        options = flex_kernel_options(T, 2) or None
        got = compiled(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options)
        err = (got - want).abs().amax((1, 3))  # [R, T]
        assert err[real].max() < 1e-5, kind
        if bm.full_kv_num_blocks.any():  # (a sliding kind's window may hold no whole block)
            bm.full_kv_num_blocks.zero_()
            dropped = compiled(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options)
            assert (dropped - want).abs().amax((1, 3))[real].max() > 1e-2, kind
            controlled.append(kind)
    assert "full_attention" in controlled
