"""Batch-invariant float32 (and bfloat16) attention for decoding and verification steps on CPU.

``csrc/decode_attention.cpp`` (built with the skinny-linear kernel, one extension per machine)
attends a few queries per row (``T`` nodes x the query heads of a key head) to the columns each
may see, read from the mask. Every query's sums run over its visible columns only, packed in column
order, so a node verified inside a draft tree gets bitwise the output it gets when decoded alone
after its ancestors were committed, whatever its row's holes and padding (SDPA's CPU kernels sum
over the whole padded row). It also reads a batch's cached keys and values faster than SDPA's kernel
at one query per row (the performance journal: ``git show 4974864:docs/performance.md``).

Use :func:`applies` to check, then :func:`attention`; :mod:`logitspec.worker.attention` does both for the
engine's decode and verification forwards.
"""
from __future__ import annotations

import torch

from . import skinny

DTYPES = (torch.float32, torch.bfloat16)  # bfloat16 is widened to float32 exactly, the output rounded back
MAX_QUERIES = 64  # nodes per row beyond which SDPA's blocked kernel is used (prefill-like shapes)


def applies(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`attention` can run ``query`` [B, H, T, D] over ``key`` [B, KV, S, D] with
    ``mask`` [B, 1, T, S] (float additive 0 / large negative, or bool) here."""
    return (mask is not None and query.device.type == "cpu" and query.dtype in DTYPES
            and key.dtype == query.dtype and mask.dtype in (torch.float32, torch.bfloat16, torch.bool)
            and query.shape[2] <= MAX_QUERIES and query.shape[-1] % 32 == 0 and mask.shape[1] == 1
            and key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0  # a TP rank may hold no head
            and tuple(mask.shape[2:]) == (query.shape[2], key.shape[2])
            and skinny.available())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """[B, T, H, D]: softmax(scale q k^T) v over each query's visible columns (``mask`` == 0, or
    True); query head h reads key head h // (H // KV), as transformers' ``repeat_kv`` orders them.
    bfloat16 inputs are computed in float32 (the kernel widens keys and values exactly as it reads
    them) and the output rounded to bfloat16."""
    last = [t if t.stride(-1) == 1 else t.contiguous() for t in (query.float(), key, value, mask)]
    return skinny.extension().decode_attention(*last, float(scale)).to(query.dtype)
