"""The engine's attention: transformers' SDPA, without copying keys per query head, packed
prefill rows attended prompt by prompt, and decoding steps by a batch-invariant kernel of our own.

Registered with transformers' ``AttentionInterface`` (and its mask function, SDPA's) as :data:`NAME`;
:func:`~logitspec.models.load_model` selects it by default. Four differences from ``sdpa``, all
exact (the same products per query row):

- **Decoding and verification steps on CPU** (at most ``decode_attention.MAX_QUERIES`` nodes per row,
  not a prefill chunk) run :mod:`logitspec.kernels.decode_attention`: each query's sums run over
  its visible columns only, in column order, so a verified node's output is bitwise the one it gets
  when decoded alone, and one query per row reads the cache 1.3-3x faster than SDPA's kernel.

- **Grouped query heads share their key head.** For more than one query with a mask, transformers
  copies every key and value to each query head (``repeat_kv``): at an 8k context a drafted step
  of 4 rows copied 65 MB a layer. Here the query heads of a group are stacked as extra queries of
  their key head and the mask repeated for them (``T x S`` per group, not ``S x D`` per head).
- **Prefill on CPU in float32** runs :mod:`logitspec.kernels.gemm_attention` (oneDNN's GEMM, 2x
  SDPA's MKL kernels on AMD CPUs) over blocks of queries (:func:`_causal_blocks`): the same
  products, summed in oneDNN's order, which is not SDPA's to the last bit; every method prefills
  through it, so their caches agree.
- **Causal chunks off CPU.** A prefill chunk of one row right after its committed columns (``causal``:
  no holes) attends through SDPA with a lower-right causal bias (:func:`causal_chunk`): flash
  attention where it runs, no mask tensor read in any layer (an 8k prompt's 512-token chunks had
  read a ``[512, S]`` mask per head and layer). Sliding-window layers keep their mask.
- **Segments.** A forward given ``segments`` (``(start, end)`` node ranges of one fresh row, each a
  prompt run from position 0: :meth:`~logitspec.worker.eager_runner.EagerRunner.prefill_rows`) attends each
  prompt to itself only, instead of the whole packed square under a block-diagonal mask.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from logitspec.kernels import decode_attention, gemm_attention
from logitspec.worker.masks import fold_groups, sdpa_aligned

NAME = "logitspec_sdpa"
PREFILL_BLOCK = 128  # queries per block of a prefill chunk (:func:`_causal_blocks`)


def attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              segments: tuple[tuple[int, int], ...] | None = None, prefill: bool = False,
              causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """``query`` [B, H, T, D], ``key``/``value`` [B, KV, S, D], ``attention_mask`` additive
    [B, 1, T, S] or None -> (output [B, T, H, D], None), as transformers' attention functions.
    ``prefill``: the queries are a causal chunk (see :func:`_causal_blocks`); ``causal``: one row's,
    right after its committed columns (query i sees keys up to ``S - T + i``; see :func:`causal_chunk`)."""
    if segments is not None:
        return _by_segment(module, query, key, value, attention_mask, segments, dropout=dropout,
                           scaling=scaling, prefill=prefill, **kwargs)
    if (not prefill and not dropout and not getattr(module, "attn_logit_softcapping", None)
            and decode_attention.applies(query, key, attention_mask)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention.attention(query, key, value, attention_mask, scale), None  # [B, T, H, D]
    groups = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    plain = not dropout and not getattr(module, "attn_logit_softcapping", None)
    if causal and plain and query.device.type != "cpu" and not getattr(module, "sliding_window", None):
        return causal_chunk(query, key, value, scaling, groups), None
    if prefill and plain and gemm_attention.applies(query, key, attention_mask):
        scale = scaling if scaling is not None else D ** -0.5
        return _causal_blocks(query, key, value, attention_mask, scale, groups, gemm=True)
    if (prefill and T > PREFILL_BLOCK and attention_mask is not None and not dropout
            and query.device.type == "cpu"):
        return _causal_blocks(query, key, value, attention_mask, scaling, groups)
    if groups == 1 or T == 1 or attention_mask is None or dropout:
        if attention_mask is not None and query.device.type != "cpu":
            attention_mask = sdpa_aligned(attention_mask)  # a segment's square starts mid-row
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    KV = key.shape[1]
    q = query.reshape(B, KV, groups * T, D)  # head h = kv * groups + g, as repeat_kv orders them
    mask = fold_groups(attention_mask, groups)  # [B, 1, groups * T, S]
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, T, value.shape[-1]).transpose(1, 2).contiguous(), None  # [B, T, H, D]


def causal_chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                 groups: int) -> torch.Tensor:
    """A causal chunk of one row after ``S - T`` committed columns: ``query`` [1, H, T, D],
    ``key``/``value`` [1, KV, S, D] -> [1, T, H, D], query i seeing keys ``[0, S - T + i]``, through
    SDPA with torch's lower-right causal bias (flash or memory-efficient attention without a mask
    tensor where they run; the materialized mask elsewhere)."""
    from torch.nn.attention.bias import causal_lower_right

    T, S = query.shape[2], key.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_lower_right(T, S), scale=scaling, enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous()


def _causal_blocks(query, key, value, mask, scaling, groups, gemm: bool = False):
    """A causal chunk's attention in blocks of ``PREFILL_BLOCK`` queries, each over only the key
    columns its rows can see: from its first row's first visible column to its last row's last
    (a causal mask, windowed or not, sees a range that only moves forward). Under Gemma 3's
    sliding window a 512-token chunk's sliding layers then read about 640 columns a block, not
    1,023, and no layer copies the mask or the keys per query head (SDPA's own GQA). ``gemm``: each
    block by :mod:`logitspec.kernels.gemm_attention` (``scaling`` given), not SDPA."""
    T = query.shape[2]
    outs = []
    for a in range(0, T, PREFILL_BLOCK):
        b = min(a + PREFILL_BLOCK, T)
        # [S]: columns the block's first row sees (in any row of the batch)
        first = (mask[:, 0, a] == 0).any(0)
        last = (mask[:, 0, b - 1] == 0).any(0)  # [S]
        lo = int(first.int().argmax())
        hi = last.numel() - int(last.flip(0).int().argmax())
        if gemm:
            outs.append(gemm_attention.attention(query[:, :, a:b], key[:, :, lo:hi], value[:, :, lo:hi],
                                                 mask[:, :, a:b, lo:hi], scaling))  # [B, b - a, H, D]
            continue
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, lo:hi], value[:, :, lo:hi], attn_mask=mask[:, :, a:b, lo:hi],
            scale=scaling, enable_gqa=groups > 1).transpose(1, 2))  # [B, b - a, H, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.contiguous(), None  # [B, T, H, D]


def _by_segment(module, query, key, value, attention_mask, segments, **kwargs):
    """Attention of one fresh row (no cached columns: ``S == T``) segment by segment."""
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"segments need one row without cached columns; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}")
    outs = []
    for a, z in segments:
        mask = attention_mask[..., a:z, a:z] if attention_mask is not None else None
        out, _ = attention(module, query[:, :, a:z], key[:, :, a:z], value[:, :, a:z], mask, **kwargs)
        outs.append(out)  # [1, z - a, H, D]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
