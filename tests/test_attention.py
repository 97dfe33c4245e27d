"""The engine's attention function (logitspec.worker.attention) against transformers' SDPA."""
import types

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from logitspec.config import SpecConfig
from logitspec.engine.engine import Engine
from logitspec.kernels import gemm_attention, onednn
from logitspec.worker.attention import NAME, PREFILL_BLOCK, attention


def _qkv(B, H, KV, T, S, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)  # [B, H, T, D]
    k, v = torch.randn(2, B, KV, S, D, generator=g)  # [B, KV, S, D] each
    # a tree-like mask: every node sees a row-dependent prefix of the cache and a random subset of nodes
    hidden = torch.rand(B, 1, T, S, generator=g) < 0.3
    hidden[..., S - T:] |= ~torch.eye(T, dtype=torch.bool) & (torch.rand(B, 1, T, T, generator=g) < 0.5)
    hidden[..., 0] = False  # every node sees at least one column
    mask = torch.zeros(B, 1, T, S).masked_fill(hidden, torch.finfo(torch.float32).min)
    return types.SimpleNamespace(num_key_value_groups=H // KV), q, k, v, mask


@pytest.mark.parametrize("B,H,KV,T,S", [(3, 4, 1, 5, 40), (2, 4, 2, 7, 19), (1, 8, 2, 16, 300)])
def test_grouped_heads_share_their_key_head_exactly(B, H, KV, T, S):
    module, q, k, v, mask = _qkv(B, H, KV, T, S)
    ours, _ = attention(module, q, k, v, mask, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)  # copies keys per query head
    assert ours.shape == (B, T, H, q.shape[-1])
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prefill", [False, True])
def test_segments_attend_each_prompt_alone(prefill):
    lengths = [3, 9, 1, 6]
    n = sum(lengths)
    module, q, k, v, _ = _qkv(1, 4, 1, n, n)
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segments = tuple((a, a + m) for a, m in zip(starts, lengths))
    block = torch.full((n, n), torch.finfo(torch.float32).min)
    for a, z in segments:
        block[a:z, a:z] = causal[:z - a, :z - a]
    ours, _ = attention(module, q, k, v, block[None, None], segments=segments,
                        prefill=prefill)  # [1, n, H, D]
    # the packed square under its mask
    whole, _ = attention(module, q, k, v, block[None, None], prefill=prefill)
    for a, z in segments:
        alone, _ = attention(module, q[:, :, a:z], k[:, :, a:z], v[:, :, a:z],
                             causal[None, None, :z - a, :z - a], prefill=prefill)
        assert torch.equal(ours[:, a:z], alone)
    torch.testing.assert_close(ours, whole, rtol=1e-6, atol=1e-6)


def test_segments_refuse_a_row_with_cached_columns():
    module, q, k, v, mask = _qkv(1, 4, 1, 4, 9)
    with pytest.raises(ValueError, match="without cached columns"):
        attention(module, q, k, v, mask, segments=((0, 4),))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_engine_output_is_the_same_under_stock_sdpa(family):
    prompts = repetitive_prompts(6, seed=3)
    outs = {}
    for attn in (NAME, "sdpa"):
        model = tiny_model(family, attn=attn)
        assert model.config._attn_implementation == attn
        for method in ("ar", "logitspec"):
            engine = Engine(model, None, SpecConfig(method=method, max_batch_size=4))
            outs[attn, method] = [r.token_ids for r in engine.run(prompts, max_new_tokens=12).results]
    assert len({str(v) for v in outs.values()}) == 1


@pytest.mark.parametrize("window", [None, 40])
def test_a_prefill_chunk_in_blocks_equals_the_whole_chunk(window):
    """A causal chunk after a cached prefix, blocked by queries over only the columns each block sees."""
    cached, T, H, D = 70, 2 * PREFILL_BLOCK + 37, 4, 8
    S = cached + T
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, H, T, D, generator=g)
    k, v = torch.randn(2, 1, 1, S, D, generator=g)
    pos = torch.arange(cached, S)[:, None]  # [T, 1]: query positions; column c holds position c
    seen = torch.arange(S)[None, :] <= pos
    if window is not None:
        seen &= pos - torch.arange(S)[None, :] < window
    mask = torch.zeros(1, 1, T, S).masked_fill(~seen, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(num_key_value_groups=H)
    blocked, _ = attention(module, q, k, v, mask, scaling=0.4, prefill=True)
    whole, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.4)
    assert blocked.shape == whole.shape == (1, T, H, D)
    torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-6)


needs_onednn = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's linear")


@needs_onednn
@pytest.mark.parametrize("B,H,KV,T,S,mask_rows",
                         [(1, 4, 1, 23, 23, 1), (2, 8, 2, 16, 300, 2), (3, 6, 3, 5, 40, 1)])
def test_gemm_attention_equals_sdpa(B, H, KV, T, S, mask_rows):
    module, q, k, v, mask = _qkv(B, H, KV, T, S)
    mask = mask[:mask_rows]
    ours = gemm_attention.attention(q, k, v, mask, 0.3)  # [B, T, H, D]
    stock, _ = sdpa_attention_forward(module, q, k, v, mask.expand(B, -1, -1, -1), scaling=0.3)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-6)


@needs_onednn
def test_float32_prefill_attention_runs_the_gemm_kernel():
    """A prefill chunk of one block is the kernel's result bitwise (not SDPA's), and only in float32."""
    module, q, k, v, mask = _qkv(1, 4, 1, PREFILL_BLOCK - 3, 200, D=16)
    ours, _ = attention(module, q, k, v, mask, scaling=0.25, prefill=True)
    assert torch.equal(ours, gemm_attention.attention(q, k, v, mask, 0.25))
    assert gemm_attention.applies(q, k, mask)
    assert not gemm_attention.applies(q.bfloat16(), k.bfloat16(), mask.bfloat16())
    assert not gemm_attention.applies(q, k, None)
    # a shard: 1 query head, 2 key heads
    assert not gemm_attention.applies(q[:, :1], k.expand(1, 2, -1, -1), mask)
    assert not gemm_attention.applies(q[:, :0], k[:, :0], mask)  # a shard without heads
