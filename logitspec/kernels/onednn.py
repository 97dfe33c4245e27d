"""Exact float32 and bfloat16 linears through oneDNN's packed-weight GEMM, where it is batch-invariant here.

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
per process (row counts 2 to 512, bitwise comparison, on :func:`probe` inputs that make any other
summation order show in nearly every output) and only shapes that pass are swapped. Elsewhere the skinny
kernel (:mod:`logitspec.kernels.skinny`) or ``F.linear`` stays.

bfloat16 (AMX or AVX-512 BF16, float32 sums): on a Sapphire Rapids class CPU every product of 1 to
32 rows gave each row the bits it gets alone, and 33 rows or more other bits on all of Gemma 3's
shapes (``F.linear`` parts from 12 rows on; on plain random inputs the 256 x 640 shape hid it). Such shapes
are computed :data:`CHUNK_ROWS` rows per call (a 2400-row prefill product 2-3x dearer than in one call, still
2-6x cheaper than float32's), except in calls of exactly the larger row counts (multiples of 32 up to 1024,
:func:`piece_sizes`, checked per shape) where one call gives every row its chunked bits again, split into the
fewest calls (:func:`spans`). Which counts do is not monotone: on Gemma 3's shapes here, from 353 rows on
for 2048 x 640, 512-640 and 687+ (with holes) for 1024 x 640, 640+ for 640 x 1024, none for
640 x 2048 (K = 2048).

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
CHECK_ROWS = (3, 5, 8, 17, 24, 33, 64, 100, 257, 512)  # row counts compared with rows computed alone
CHUNK_ROWS = 32  # rows per call where a shape is invariant only up to that many rows (bfloat16 here)
# Larger calls of exactly these row counts, where one such call gives every row its chunked bits
# (oneDNN picks its kernel by shape, not by data): checked per shape, all rows, two inputs.
PIECE_ROWS = tuple(range(1024, CHUNK_ROWS, -CHUNK_ROWS))  # 1024, 992, ..., 64
PROBE_BIG = 2.0 ** 22  # the cancelling pair of :func:`probe` (exact in bfloat16)


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


def linear(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, chunk: int = 0,
           pieces: tuple[int, ...] = ()) -> torch.Tensor:
    """``x2`` [n, I] @ the packed weight^T (+ bias) -> [n, O], in the weight's dtype; one row runs as
    two (the path taken for more rows, so the result is the row's in any batch). ``chunk`` > 0: at
    most that many rows per oneDNN call, or exactly one of ``pieces`` (see :func:`spans`). ``packed``
    may also be a plain contiguous [O, I] tensor, which oneDNN reorders on each call (operands that
    change per call, as :mod:`logitspec.kernels.gemm_attention`'s keys and values do)."""
    if 0 < chunk < x2.shape[0]:
        return torch.cat([linear(x2[a:b], packed, bias) for a, b in spans(x2.shape[0], chunk, pieces)])
    one = x2.shape[0] == 1
    if one:
        x2 = x2.expand(2, -1)
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")  # [n, O]
    return y[:1] if one else y


def probe(out_features: int, in_features: int, rows: int, dtype: torch.dtype, seed: int):
    """(w [O, I], x [rows, I]) whose products show their summation order: random values, and in each
    row of ``x`` a pair ``+PROBE_BIG, -PROBE_BIG`` at two far-apart columns whose weight columns are
    equal, so the pair cancels exactly but the partial sums that hold one of it round away the other
    terms' low bits. Two kernels that sum in other orders then differ in nearly every output, even
    once rounded to bfloat16 (on plain random inputs a different order showed in 1 of 16k outputs:
    oneDNN's bfloat16 256 x 640 product passed such a check and parted on real hidden states)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    x = torch.randn(rows, in_features, generator=g)
    h = in_features // 2
    if h >= 2:
        pairs = [(0, in_features - 1), (h // 2, h + h // 2), (h - 1, h), (1, h + 1)]
        r = torch.arange(rows)
        for k, (a, b) in enumerate(pairs):
            w[:, b] = w[:, a]
            x[r[r % len(pairs) == k], a] = PROBE_BIG
            x[r[r % len(pairs) == k], b] = -PROBE_BIG
    return w.to(dtype), x.to(dtype)


@functools.lru_cache(maxsize=None)
def batch_invariant(out_features: int, in_features: int, threads: int, dtype: torch.dtype = torch.float32,
                    chunk: int = 0) -> bool:
    """Whether, for a weight of this shape and dtype at ``threads`` torch threads, the rows of an
    n-row product (``chunk`` rows per call, 0: one call) equal bitwise the same rows computed alone,
    on :func:`probe` inputs, for n in ``CHECK_ROWS`` and every n up to ``chunk`` + 1: rows 0-33,
    every 7th and each product's middle and last (a row alone reads the whole weight)."""
    del threads  # part of the cache key: oneDNN's split of the work depends on it
    counts = sorted(set(CHECK_ROWS) | set(range(1, chunk + 2)))
    w, x = probe(out_features, in_features, max(counts), dtype, out_features * 7919 + in_features)
    packed = pack(w)
    rows = sorted(set(range(34)) | set(range(0, max(counts), 7)) | {n - 1 for n in counts}
                  | {n // 2 for n in counts})
    with torch.inference_mode():
        alone = {i: linear(x[i:i + 1], packed) for i in rows}  # [1, O] each
        for n in counts:
            y = linear(x[:n], packed, chunk=chunk)  # [n, O]
            if not all(torch.equal(y[i:i + 1], alone[i]) for i in rows if i < n):
                return False
    return True


def spans(n: int, chunk: int, pieces: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """The row ranges of a chunked product's calls, as few as possible: whole ``pieces`` (row counts,
    multiples of ``chunk``; largest first) and ``chunk``-row calls covering ``n // chunk * chunk``
    rows, then the last ``n % chunk`` rows in one call. Cached per (n, chunk, pieces): every linear
    of a forward asks the same."""
    return list(_spans(n, chunk, tuple(pieces)))


@functools.lru_cache(maxsize=4096)
def _spans(n: int, chunk: int, pieces: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    if any(p % chunk for p in pieces):
        raise ValueError(f"pieces must be multiples of chunk={chunk}, got {pieces}")
    units = n // chunk
    sizes = sorted({p // chunk for p in pieces if p // chunk <= units} | {1})  # in chunks
    calls, last = [0] + [units + 1] * units, [0] * (units + 1)  # fewest calls for u chunks; its last size
    for u in range(1, units + 1):
        for size in sizes:
            if size <= u and calls[u - size] + 1 < calls[u]:
                calls[u], last[u] = calls[u - size] + 1, size
    used, u = [], units
    while u:
        used.append(last[u])
        u -= last[u]
    bounds = [0]
    for size in sorted(used, reverse=True):
        bounds.append(bounds[-1] + size * chunk)
    if n % chunk:
        bounds.append(n)
    return tuple(zip(bounds, bounds[1:]))


@functools.lru_cache(maxsize=None)
def piece_sizes(out_features: int, in_features: int, threads: int, dtype: torch.dtype) -> tuple[int, ...]:
    """For a shape computed ``CHUNK_ROWS`` rows per call: the counts of ``PIECE_ROWS`` whose one call
    gives every row of two :func:`probe` inputs the bits ``CHUNK_ROWS``-row calls give it."""
    del threads  # part of the cache key
    seed = out_features * 7919 + in_features + 1
    ok = []
    with torch.inference_mode():
        probes = [probe(out_features, in_features, max(PIECE_ROWS), dtype, seed + k) for k in range(2)]
        packed = [pack(w) for w, _ in probes]
        chunked = [linear(x, p, chunk=CHUNK_ROWS) for (_, x), p in zip(probes, packed)]  # [R, O]: bits alone
        for n in PIECE_ROWS:
            if all(torch.equal(linear(x[:n], p), c[:n]) for (_, x), p, c in zip(probes, packed, chunked)):
                ok.append(n)
    return tuple(ok)


def rows_per_call(out_features: int, in_features: int, threads: int,
                  dtype: torch.dtype = torch.float32) -> int | None:
    """The ``chunk`` that makes this weight shape's products batch-invariant here: 0 (any row count
    in one call), :data:`CHUNK_ROWS`, or None (neither: leave the shape to other kernels)."""
    return next((c for c in (0, CHUNK_ROWS) if batch_invariant(out_features, in_features, threads, dtype, c)),
                None)


def dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN's packed linear runs here."""
    return (torch.float32, torch.bfloat16) if bf16_supported() else (torch.float32,)


class OneDnnLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` with a packed copy of its weight (``packed``, in the
    weight's dtype) for inputs of that dtype on CPU outside autograd, ``chunk`` rows per call at
    most (0: all in one) or exactly one of ``pieces`` (see :func:`spans`); ``F.linear`` otherwise."""

    max_rows: int = 0  # unused (swap_linears sets it)
    packed: torch.Tensor | None = None
    chunk: int = 0
    pieces: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.packed is None or x.dtype != self.weight.dtype or x.device.type != "cpu"
                or (torch.is_grad_enabled() and x.requires_grad)):
            return super().forward(x)
        y = linear(x.reshape(-1, x.shape[-1]), self.packed, self.bias, self.chunk, self.pieces)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every plain float32 or bfloat16 (where oneDNN runs it) CPU ``nn.Linear`` of ``model``
    whose weight shape is batch-invariant here (:func:`rows_per_call`) by :class:`OneDnnLinear`,
    except the output embedding (computed by ``logitspec.worker.head``). Returns the count swapped (0
    without oneDNN)."""
    if not available():
        return 0
    out = getattr(model, "get_output_embeddings", lambda: None)()
    skip = [out.weight] if out is not None and getattr(out, "weight", None) is not None else []
    threads = torch.get_num_threads()
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]
    kinds = {(*m.weight.shape, m.weight.dtype) for m in linears if m.weight.dtype in dtypes()}
    chunks = {k: rows_per_call(k[0], k[1], threads, k[2]) for k in kinds}
    refused = sorted(str(k) for k, c in chunks.items() if c is None)
    if refused:
        logger.info("oneDNN linears not batch-invariant here for weight shapes %s: left to other kernels",
                    refused)
    skip += [m.weight for m in linears if chunks.get((*m.weight.shape, m.weight.dtype)) is None]
    n = swap_linears(model, OneDnnLinear, 0, skip_weights=skip)
    for m in model.modules():
        if type(m) is OneDnnLinear and m.packed is None:
            m.packed = pack(m.weight)
            m.chunk = chunks[(*m.weight.shape, m.weight.dtype)]
            if m.chunk:
                m.pieces = piece_sizes(*m.weight.shape, threads, m.weight.dtype)
    return n
