"""The engine's attention function (logitspec.worker.attention) against transformers' SDPA."""
import types

import pytest
import torch
from tiny_models import repetitive_prompts, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from logitspec.config import SpecConfig
from logitspec.engine.engine import Engine
from logitspec.kernels import gemm_attention, onednn
from logitspec.worker.attention import NAME, PREFILL_BLOCK, attention, causal_chunk


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


@pytest.mark.parametrize("H,KV,T,S", [(4, 1, 5, 40), (8, 2, 16, 16), (4, 4, 7, 300)])
def test_a_causal_chunk_attends_as_its_mask_says(H, KV, T, S):
    """The fused causal path (a lower-right causal bias, no mask tensor) equals SDPA under the dense
    mask of a chunk after ``S - T`` committed columns: query i sees keys ``[0, S - T + i]``."""
    module, q, k, v, _ = _qkv(1, H, KV, T, S)
    rows, cols = torch.arange(T)[:, None], torch.arange(S)[None, :]
    mask = torch.zeros(1, 1, T, S).masked_fill(cols > S - T + rows, torch.finfo(torch.float32).min)
    stock, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got = causal_chunk(q, k, v, 0.3, H // KV)
    torch.testing.assert_close(got, stock, rtol=1e-5, atol=1e-5)


def test_only_a_plain_causal_chunk_off_cpu_skips_its_mask():
    """Off CPU (meta tensors here) a ``causal`` chunk runs the lower-right causal bias and never reads
    the mask; a sliding-window layer, a chunk not marked causal and every CPU call read it."""
    from torch.nn.attention.bias import CausalBias
    from torch.overrides import TorchFunctionMode

    class Masks(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                self.seen.append(type(kwargs.get("attn_mask")))
            return func(*args, **kwargs)

    def masks(device, causal=True, window=None):
        module, q, k, v, mask = _qkv(1, 4, 2, 8, 40)
        module.sliding_window = window
        with Masks() as m:
            attention(module, *(t.to(device) for t in (q, k, v, mask)), scaling=0.3, prefill=True,
                      causal=causal)
        return m.seen

    assert masks("meta") == [CausalBias]
    assert CausalBias not in masks("meta", causal=False) + masks("meta", window=16) + masks("cpu")


def test_the_eager_runner_marks_a_chunk_causal_only_after_its_rows_columns():
    """``extend`` of a one-row cache without holes is a causal chunk; a decoding step is not."""
    from logitspec.worker.eager_runner import EagerRunner
    from logitspec.worker.head import OutputMode
    from logitspec.worker.masks import StepRow

    runner = EagerRunner(tiny_model("llama"))
    seen = []
    head = runner.head

    def recording(*args, attn=None, **kw):
        seen.append(bool((attn or {}).get("causal")))
        return head(*args, attn=attn, **kw)

    runner.head = recording
    with torch.inference_mode():
        row = runner.new_row()
        runner.extend(row, [5, 6, 7, 8])
        runner.extend(row, [9, 10])
        runner(rows=[StepRow.chain(6, [11, 12])], kv=row, all_logits=True, mode=OutputMode.EXACT)
    assert seen == [True, True, False]
