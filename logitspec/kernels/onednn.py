"""Exact float32 linears through oneDNN's packed-weight GEMM, where it is batch-invariant here.

torch's oneDNN ops (``torch.ops.mkldnn``) multiply by a weight reordered once into oneDNN's blocked
layout. On this project's CPU (AVX-512, 2 threads) that ran the decoder's linears of Gemma 3 270M at
310-550 GFLOP/s from 6 rows on, against MKL's ``F.linear`` at 76-235 (MKL takes its AVX2 path on this
AMD CPU) and our skinny kernel's few-row streaming; at one row it equals the skinny kernel
(docs/performance.md, "oneDNN linears").

Speculative decoding must give the tokens plain decoding gives, so a row's result must not depend
on how many rows share its product (batch invariance): a verification forward of k nodes has to
compute each node exactly as a one-token step would. oneDNN takes a different path for a single
row on some shapes, so one row is computed as two (the row twice); whether the rest is invariant
depends on the CPU and the thread count, so :func:`batch_invariant` checks each weight shape once
per process (random inputs, row counts 2 to 512, bitwise comparison) and only shapes that pass are
swapped. Elsewhere the skinny kernel (:mod:`logitspec.kernels.skinny`) or ``F.linear`` stays.

Use::

    from logitspec.kernels import onednn
    onednn.use_onednn_linears(model)  # nn.Linear -> OneDnnLinear where invariant; lm_head left alone

The packed weight is a copy (the original stays: other code reads ``weight``).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from .swap import swap_linears

logger = logging.getLogger("logitspec.onednn")

PACK_ROWS = 64  # the row count oneDNN's reorder is told to expect (any >= 2 measured the same)
CHECK_ROWS = (3, 5, 8, 17, 24, 33, 64, 100, 257, 512)  # row counts compared with two-row products


def available() -> bool:
    """Whether torch has oneDNN's packed linear on this CPU."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and check())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [O, I] (float32 or bfloat16) in oneDNN's layout (an opaque tensor, a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def linear(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2`` [n, I] @ the packed weight^T (+ bias) -> [n, O], in the weight's dtype; one row runs as
    two (the path taken for more rows, so the result is the row's in any batch)."""
    one = x2.shape[0] == 1
    if one:
        x2 = x2.expand(2, -1)
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")  # [n, O]
    return y[:1] if one else y


@functools.lru_cache(maxsize=None)
def batch_invariant(out_features: int, in_features: int, threads: int) -> bool:
    """Whether, for a weight of this shape at ``threads`` torch threads, every row of an n-row
    product equals (bitwise) the same row computed in a two-row product, for n in ``CHECK_ROWS``."""
    del threads  # part of the cache key: oneDNN's split of the work depends on it
    g = torch.Generator().manual_seed(out_features * 7919 + in_features)
    w = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    x = torch.randn(max(CHECK_ROWS), in_features, generator=g)
    packed = pack(w)
    with torch.inference_mode():
        first = linear(x[:2], packed)[:1]  # row 0 in a two-row product
        for n in CHECK_ROWS:
            y = linear(x[:n], packed)  # [n, O]
            last = linear(x[n - 1:n], packed)
            if not (torch.equal(y[:1], first) and torch.equal(y[n - 1:], last)):
                return False
    return True


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` with a packed copy of its weight (``packed``) for
    float32 inputs on CPU outside autograd; ``F.linear`` otherwise."""

    max_rows: int = 0  # unused (swap_linears sets it)
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.packed is None or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and x.requires_grad)):
            return super().forward(x)
        y = linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every plain float32 CPU ``nn.Linear`` of ``model`` whose weight shape is batch-invariant
    here (:func:`batch_invariant`) by :class:`OneDnnLinear`, except the output embedding (computed by
    ``logitspec.head``). Returns the count swapped (0 without oneDNN)."""
    if not available():
        return 0
    out = getattr(model, "get_output_embeddings", lambda: None)()
    skip = [out.weight] if out is not None and getattr(out, "weight", None) is not None else []
    threads = torch.get_num_threads()
    shapes = {tuple(m.weight.shape) for m in model.modules() if type(m) is nn.Linear
              and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"}
    refused = sorted(s for s in shapes if not batch_invariant(*s, threads))
    if refused:
        logger.info("oneDNN linears not batch-invariant here for weight shapes %s: left to other kernels", refused)
    skip += [m.weight for m in model.modules() if type(m) is nn.Linear and
             (tuple(m.weight.shape) in refused or m.weight.dtype != torch.float32 or m.weight.device.type != "cpu")]
    n = swap_linears(model, OneDnnLinear, 0, skip_weights=skip)
    for m in model.modules():
        if type(m) is OneDnnLinear and m.packed is None:
            m.packed = pack(m.weight)
    return n
