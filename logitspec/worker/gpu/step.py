"""A step's inputs in static buffers, its masks built from them on the device, and the attention
function that reads them.

Per (rows bucket R, nodes bucket T) one :class:`StepBuffers` holds, on the model's device, the
step's node tokens, positions, depths, parents and each row's cache length (one int64 buffer,
filled by one ``copy_`` from pinned host memory) and the tree's ancestor matrix (one bool buffer).
Everything the forward reads is computed from those buffers on the device, so a captured forward
replays correctly after the buffers are refilled.

Visibility, one rule for both attention paths (:func:`visible`): node i of row b (length L_b)
sees committed columns ``[0, L_b)`` and the columns ``L_b + j`` of its ancestors j (itself
included), and under a sliding window only those within the window of its position. Pad nodes
(depth -1: rows' nodes past their own, and every node of a pad row) see only themselves; their
outputs are never read and they are never accepted.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from logitspec.worker import attention as eager_attention

NAME = "logitspec_graph"
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# flex attention's query block: one block holds all of a row's nodes (T <= 64 in a bucket)
Q_BLOCK = 128
# queries below which inductor picks its flex decoding kernel (torch/_inductor/kernel/flex/flex_decoding.py,
# _use_flex_decoding); at 128 and above its main kernel runs
FLEX_DECODING_MAX_QUERIES = 127


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def flex_kernel_options(T: int, groups: int) -> dict:
    """flex attention's kernel options for a step of ``T`` query nodes per row with ``groups`` query
    heads per key head, so inductor finds a kernel on CUDA. Its flex decoding kernel (taken for
    fewer than 128 queries when ``groups`` is a power of two) stacks a group's queries into one tile
    of ``max(16, next_pow2(T * groups))`` rows and accepts only a query block that is a multiple of
    it (else "no valid choices": a Llama-3 model, 4 groups, fails past 32 nodes). Where the tile
    would outgrow :data:`Q_BLOCK`, the main kernel (a tile per query head, 64 or 128 rows) runs
    instead: a tile of 256-512 rows of 128-wide heads would not fit a GPU's registers."""
    decoding = T <= FLEX_DECODING_MAX_QUERIES and groups & (groups - 1) == 0
    if decoding and max(16, next_pow2(T * groups)) > Q_BLOCK:
        return {"FORCE_USE_FLEX_ATTENTION": True}
    return {}


def bucket(n: int, sizes) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n``."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


class StepBuffers:
    """Static inputs of one (rows R, nodes T) bucket, on ``device``; see the module docstring."""

    def __init__(self, R: int, T: int, device: torch.device):
        self.R, self.T = R, T
        pin = device.type == "cuda"
        self._host_ints = torch.zeros(4 * R * T + R, dtype=torch.int64, pin_memory=pin)
        self._host_anc = torch.zeros(R, T, T, dtype=torch.bool, pin_memory=pin)
        self.ints = torch.zeros(4 * R * T + R, dtype=torch.int64, device=device)
        self.anc = torch.zeros(R, T, T, dtype=torch.bool, device=device)  # [R, T, T]: node i sees node j
        self.ids, self.pos, self.depths, self.parents = self.ints[:4 * R * T].view(4, R, T)  # [R, T] each
        self.lens = self.ints[4 * R * T:]  # [R]
        self.node = torch.arange(T, device=device)  # [T]
        self.hidden: torch.Tensor | None = None  # [R * T, hidden]: the forward's output, written in place
        self.decision: torch.Tensor | None = None  # [R, 2 + top + T] int64: a decided step's, in place
        self.decision_host: torch.Tensor | None = None  # its pinned host copy (CUDA)
        # the last fill's copies: the host staging buffers are rewritten only once they are done
        self._copied = torch.cuda.Event() if pin else None

    def fill(self, rows, lengths: list[int]) -> None:
        """Write ``rows`` (:class:`~logitspec.worker.masks.StepRow`, row b against ``lengths[b]`` committed
        columns) and pads into the host staging buffers, then copy them to the device (no wait)."""
        R, T = self.R, self.T
        if self._copied is not None:
            self._copied.synchronize()  # (an engine step has waited for its acceptance by now: free)
        h = self._host_ints.numpy()
        planes = h[:4 * R * T].reshape(4, R, T)
        planes[0] = 0
        planes[2:4] = -1
        lens = h[4 * R * T:]
        lens[:] = 0
        anc = self._host_anc.numpy()
        anc[:] = np.eye(T, dtype=bool)
        planes[1] = np.arange(T)  # pad rows: positions 0..T-1 (any: their outputs are never read)
        for b, r in enumerate(rows):
            n = len(r.tokens)
            L = lengths[b]
            if r.prefix_len != L:
                raise ValueError(f"row {b}: step built for {r.prefix_len} cached tokens, the slot holds {L}")
            planes[0, b, :n] = r.tokens
            planes[1, b] = L + np.arange(T)  # pads: the columns they are written at
            planes[1, b, :n] = L + r.depths
            planes[2, b, :n] = r.depths
            planes[3, b, :n] = r.parents
            anc[b, :n, :n] = r.visible
            lens[b] = L
        self.ints.copy_(self._host_ints, non_blocking=True)
        self.anc.copy_(self._host_anc, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def write_cols(self) -> torch.Tensor:
        """[R, T] int64: the cache column each node is written at (``lens[b] + i``), on the device."""
        return self.lens[:, None] + self.node


def visible(buf: StepBuffers, b, q, kv, window: int | None):
    """Whether node ``q`` of row ``b`` sees cache column ``kv`` (tensors that broadcast, or the
    scalars of a flex attention ``mask_mod``); see the module docstring."""
    T = buf.T
    L = buf.lens[b]
    rel = kv - L
    j = rel.clamp(0, T - 1)
    in_tree = (rel >= 0) & (rel < T)
    seen = ((kv < L) & (buf.depths[b, q] >= 0)) | (in_tree & buf.anc[b, q, j])
    if window is not None:
        kv_pos = torch.where(in_tree, buf.pos[b, j], kv)  # committed columns: column = position
        seen = seen & (buf.pos[b, q] - kv_pos < window)
    return seen


def sdpa_mask_for(buf: StepBuffers, key_len: int, window: int | None, groups: int, dtype: torch.dtype):
    """Additive mask [R, 1, groups * T, key_len] (query heads of a group stacked along the queries,
    as :func:`graph_attention` folds them), built on the device from the buffers."""
    dev = buf.ids.device
    b = torch.arange(buf.R, device=dev)[:, None, None]
    q = buf.node[None, :, None]
    kv = torch.arange(key_len, device=dev)[None, None, :]
    seen = visible(buf, b, q, kv, window)  # [R, T, key_len]
    zero = torch.zeros((), dtype=dtype, device=dev)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=dev)
    mask = torch.where(seen, zero, low)  # [R, T, key_len]
    R, T = buf.R, buf.T
    return mask[:, None].expand(R, groups, T, key_len).reshape(R, 1, groups * T, key_len)


class FlexMasks:
    """A flex attention ``BlockMask`` per attention kind over a bucket's buffers, rewritten in place
    by :meth:`update` inside the forward (device ops only). Per row, the key blocks that every real
    node sees whole (committed columns, within every node's window) are *full* blocks, read without
    the ``mask_mod``; the others up to the row's last node (``L_b + T``, from its window's first
    block for sliding layers) are *partial* blocks, where the ``mask_mod`` (:func:`visible`) decides.
    So the mask is evaluated only on the tree's tail: one block per row in a one-node step. A pad
    node (never read) sees the full blocks too."""

    def __init__(self, buf: StepBuffers, max_len: int, windows: dict, block: int):
        from torch.nn.attention.flex_attention import BlockMask

        if max_len % block:
            raise ValueError(f"flex attention needs a slot length ({max_len}) divisible by its block "
                             f"({block})")
        self.buf, self.block, self.windows = buf, block, windows
        dev = buf.ids.device
        nb = max_len // block
        # query blocks: one, but for steps beyond the buckets of more than Q_BLOCK nodes (each reads the
        # row's whole lists: a row's nodes all end at L_b + T)
        self.q_blocks = qb = -(-buf.T // Q_BLOCK)
        self.arange = torch.arange(nb, device=dev, dtype=torch.int32)
        self.columns = self.arange.long()  # [nb]: block numbers, as the lengths' dtype
        self.masks = {}
        for kind, window in windows.items():
            lists = [torch.ones(buf.R, 1, qb, dtype=torch.int32, device=dev),  # partial: count, indices
                     self.arange.expand(buf.R, 1, qb, nb).contiguous(),
                     torch.zeros(buf.R, 1, qb, dtype=torch.int32, device=dev),  # full: count, indices
                     self.arange.expand(buf.R, 1, qb, nb).contiguous()]

            def mask_mod(b, h, q, kv, window=window):
                return visible(buf, b, q, kv, window)
            kwargs = dict(full_kv_num_blocks=lists[2], full_kv_indices=lists[3], BLOCK_SIZE=(Q_BLOCK, block),
                          mask_mod=mask_mod, seq_lengths=(buf.T, max_len))
            try:
                bm = BlockMask.from_kv_blocks(lists[0], lists[1], compute_q_blocks=False, **kwargs)
            except TypeError:  # older torch: no compute_q_blocks (the transposed blocks serve backward only)
                bm = BlockMask.from_kv_blocks(lists[0], lists[1], **kwargs)
            self.masks[kind] = (bm, lists)

    def update(self) -> dict:
        """Rewrite each kind's block lists from the buffers (device ops only); the block masks by kind."""
        buf, B = self.buf, self.block
        L = buf.lens  # [R]
        nb = len(self.arange)
        last = (L + buf.T + B - 1) // B  # [R]: blocks up to the row's last node (exclusive)
        committed = L // B  # [R]: blocks wholly before the row's first node
        j = self.columns  # [nb]
        for kind, (bm, (num, idx, full_num, full_idx)) in self.masks.items():
            window = self.windows[kind]
            if window is None:
                first = full_first = torch.zeros_like(L)
            else:  # depth d (position L + d) sees columns > L + d - window; every node: >= L + T - window
                first = (L - window + 1).clamp(min=0) // B
                full_first = torch.maximum((L + buf.T - window).clamp(min=0) + B - 1, first * B) // B
            has_full = committed > full_first
            full_first = torch.where(has_full, full_first, last)  # no full block: partial = [first, last)
            full_end = torch.where(has_full, committed, last)
            head = full_first - first  # partial blocks before the full ones
            R, qb = buf.R, self.q_blocks  # every query block of a row reads the row's lists
            full_num.copy_((full_end - full_first).view(R, 1, 1).expand(R, 1, qb))
            full_idx.copy_((full_first[:, None] + j).clamp(max=nb - 1).view(R, 1, 1, -1).expand(R, 1, qb, nb))
            num.copy_((head + last - full_end).view(R, 1, 1).expand(R, 1, qb))
            part = torch.where(j < head[:, None], first[:, None] + j, full_end[:, None] + j - head[:, None])
            idx.copy_(part.clamp(max=nb - 1).view(R, 1, 1, -1).expand(R, 1, qb, nb))
        return {kind: bm for kind, (bm, _) in self.masks.items()}


_FLEX = {}


def flex(device: torch.device):
    """flex_attention: compiled off CPU (its fused kernel), eager on CPU (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu":
        return flex_attention
    if "compiled" not in _FLEX:
        from logitspec.worker.gpu.fused import raise_recompile_limit

        # one compile per (rows, nodes) bucket and kind: dozens, past dynamo's default of 8 per function
        # (past it, flex attention would fall back to its unfused eager form)
        raise_recompile_limit()
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["compiled"]


def graph_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    dropout: float = 0.0, scaling: float | None = None, graph_step: bool = False, **kwargs):
    """``query`` [R, H, T, D], ``key``/``value`` [R, KV, S, D] -> ([R, T, H, D], None). In a graph
    runner's step (``graph_step``): a flex ``BlockMask`` runs flex attention; an additive mask
    [R, 1, G * T, S] runs SDPA with the G query heads of each key head stacked along the queries (no
    key copy per head). Otherwise (prefill, the eager path) :func:`logitspec.worker.attention.attention`."""
    if not graph_step:
        return eager_attention.attention(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, **kwargs)
    R, H, T, D = query.shape
    KV = key.shape[1]
    if H == 0:  # a tensor-parallel rank without heads in this layer (AutoTP keeps them on rank 0)
        return query.new_zeros(R, T, 0, value.shape[-1]), None
    if not isinstance(attention_mask, torch.Tensor):  # a BlockMask
        out = flex(query.device)(query, key, value, block_mask=attention_mask, scale=scaling,
                                 enable_gqa=KV != H, kernel_options=flex_kernel_options(T, H // KV) or None)
        return out.transpose(1, 2).contiguous(), None
    q = query.reshape(R, KV, (H // KV) * T, D)  # head h = kv * G + g, as repeat_kv orders them
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(R, H, T, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, graph_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
