"""Masked attention of a block of queries as two oneDNN GEMMs (scores, then weighted values), float32 on CPU.

torch's CPU attention (SDPA's flash kernel, and ``matmul``) multiplies with MKL, which takes its AVX2
path on AMD CPUs: about 210 GFLOP/s for Gemma 3's score product on this project's 2-core AVX-512
EPYC, where oneDNN's GEMM (the one :mod:`logitspec.kernels.onednn` runs the linears with, here on
plain unpacked operands) ran it at 440-480 GFLOP/s from 128 queries on (a script since removed:
``git show 4974864:scripts/prefill_attention_ab.py``). A key head's query heads are stacked as rows
of one product (grouped-query attention reads each key once), and the softmax is torch's, in float32.

A query row's result depends only on its block's shapes and values (the same prompt gives the same
bits in any packing of prompts), but not bitwise on SDPA's: the engine runs every float32 prefill
on CPU through it, so plain and speculative decoding start from the same cache.
"""
from __future__ import annotations

import torch

from . import onednn

ENABLED = True  # False: prefill attention goes back to SDPA (for side-by-side measurements)


def applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` runs these inputs: float32 on CPU with an additive mask, whole groups
    of query heads per key head (a tensor-parallel shard may hold no heads, or fewer query heads than key
    heads), oneDNN present and :data:`ENABLED`."""
    H, KV = query.shape[1], key.shape[1]
    return (query.device.type == "cpu" and query.dtype == torch.float32 and mask is not None
            and mask.dtype == torch.float32 and 0 < KV <= H and H % KV == 0 and ENABLED
            and onednn.available())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """``query`` [B, H, T, D], ``key`` [B, KV, S, D], ``value`` [B, KV, S, Dv], ``mask`` additive
    [B or 1, 1, T, S] (each query row sees at least one column) -> output [B, T, H, Dv]."""
    B, H, T, D = query.shape
    KV, S, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = H // KV
    out = query.new_empty(B, T, H, Dv)
    for b in range(B):
        m = mask[b if mask.shape[0] > 1 else 0, 0]  # [T, S]
        for h in range(KV):
            q = query[b, h * G:(h + 1) * G].reshape(G * T, D)  # [G*T, D]: head g's rows g*T..g*T+T-1
            scores = onednn.linear(q, key[b, h].contiguous())  # [G*T, S]
            scores = scores.view(G, T, S).mul_(scale).add_(m)  # [G, T, S]
            probs = torch.softmax(scores, dim=-1).view(G * T, S)
            o = onednn.linear(probs, value[b, h].t().contiguous())  # [G*T, Dv]
            out[b, :, h * G:(h + 1) * G] = o.view(G, T, Dv).transpose(0, 1)
    return out
