"""Pack per-sequence draft trees into one forward: tokens, positions and 4D attention masks.

Layout of the KV columns seen by a step (``L`` cached columns + ``T`` new ones):
row b's committed tokens are columns ``[0, prefix_len[b])`` (position = column), columns
``[prefix_len[b], L)`` are holes, and the new tree nodes are columns ``L + i``.

The host builds only the small per-node arrays; the masks (``B x T x (L + T)``) are built on the
model's device from them, so no large host tensor crosses to the device each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from logitspec.device import to_device
from logitspec.spec_decode.tree import DraftTree

FULL, SLIDING = "full_attention", "sliding_attention"
# off CPU, mask rows are padded to a multiple of this many columns: SDPA's memory-efficient kernel
# copies a mask whose strides are not multiples of its alignment, in every layer
MASK_ALIGN = 16


@dataclass(frozen=True)
class StepRow:
    """One sequence's part of a step: ``tokens`` placed at positions ``prefix_len + depths``."""

    prefix_len: int
    tokens: np.ndarray  # int64 [n]
    depths: np.ndarray  # int64 [n]
    visible: np.ndarray  # bool [n, n]: node i attends to node j
    parents: np.ndarray  # int64 [n]: parent node, -1 for the root

    @classmethod
    def from_tree(cls, prefix_len: int, tree: DraftTree) -> "StepRow":
        return cls(prefix_len, tree.tokens, tree.depths, tree.ancestor_mask(), tree.parents)

    @classmethod
    def chain(cls, prefix_len: int, tokens) -> "StepRow":
        """A causal chunk of ``tokens`` (prefill)."""
        n = len(tokens)
        return cls(prefix_len, np.asarray(tokens, dtype=np.int64), np.arange(n, dtype=np.int64),
                   np.tril(np.ones((n, n), dtype=bool)), np.arange(n, dtype=np.int64) - 1)


    @classmethod
    def side_by_side(cls, prompts: list) -> "StepRow":
        """Several fresh prompts as causal chunks back to back in one row, each from position 0 and
        seeing only itself (a ragged prefill: no padding to the longest)."""
        lens = [len(p) for p in prompts]
        seg = np.repeat(np.arange(len(lens)), lens)  # [n]: which prompt each node belongs to
        depths = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])  # [n]
        n = len(seg)
        visible = (seg[:, None] == seg[None, :]) & np.tril(np.ones((n, n), dtype=bool))  # [n, n]
        parents = np.arange(n, dtype=np.int64) - 1
        parents[depths == 0] = -1
        tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        return cls(0, tokens, depths, visible, parents)


@dataclass
class PackedStep:
    """One step's rows as device tensors: the model's inputs and the tree structure the acceptance
    walk needs. Padding nodes (past a row's ``sizes[b]``) see only themselves."""

    ids: torch.Tensor  # int64 [B, T]
    pos: torch.Tensor  # int64 [B, T]: prefix_len + depth (padding: 0)
    depths: torch.Tensor  # int64 [B, T]: depth in the tree (padding: -1)
    parents: torch.Tensor  # int64 [B, T]: parent node in the row (root and padding: -1)
    visible: torch.Tensor  # bool [B, T, T]: node i attends to node j of its row (ancestors and itself)
    mask: torch.Tensor | dict  # additive [B, 1, T, L - start + T], or a dict of them keyed by layer type
    sizes: list[int]  # real nodes per row
    starts: dict[str, int]  # per layer type, the first cache column its mask covers (0: all of them)


def layer_windows(config) -> dict[str, int | None]:
    """Attention kinds used by the model's layers -> sliding window (None for full attention)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(cfg, "layer_types", None) or [FULL])
    unknown = kinds - {FULL, SLIDING}
    if unknown:
        raise NotImplementedError(f"unsupported attention layer types: {sorted(unknown)}")
    return {k: (cfg.sliding_window if k == SLIDING else None) for k in sorted(kinds)}


def pack(rows: list[StepRow], cache_len: int, windows: dict[str, int | None], dtype: torch.dtype,
         device: torch.device | str = "cpu", trim: bool = False) -> PackedStep:
    """Pack ``rows`` for a forward adding ``T`` columns to a ``cache_len``-column cache on ``device``:
    the masks are additive in ``dtype`` (0 visible, ``finfo(dtype).min`` hidden), correct under both
    ``eager`` and ``sdpa`` (a boolean mask is silently wrong under ``eager``, and SDPA turns one into
    a float bias again in every layer). ``trim``: a sliding-window kind's mask starts at the first
    column any node can see (``starts``), and the cache must hand those layers only the columns from
    there on (:meth:`~logitspec.worker.kv_cache.BatchKV.attend_from`): at long context their attention then
    costs the window, not the whole cache."""
    device = torch.device(device)
    B, T = len(rows), max(len(r.tokens) for r in rows)
    host = np.zeros((4, B, T), dtype=np.int64)  # ids, positions, depths, parents
    host[2:] = -1
    prefix = np.zeros(B, dtype=np.int64)
    vis = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T)).copy()
    for b, r in enumerate(rows):
        n = len(r.tokens)
        host[0, b, :n] = r.tokens
        host[1, b, :n] = r.prefix_len + r.depths
        host[2, b, :n] = r.depths
        host[3, b, :n] = r.parents
        vis[b, :n, :n] = r.visible
        prefix[b] = r.prefix_len
    ints = to_device(np.concatenate([host.reshape(-1), prefix]), device)  # one transfer: [4 B T + B]
    ids, pos, depths, parents = ints[:4 * B * T].view(4, B, T)
    visible = to_device(vis, device)  # [B, T, T]
    # a node at position p >= its row's prefix sees columns > p - window: none before min(prefix) - window + 1
    starts = {kind: max(0, int(prefix.min()) - w + 1) if trim and w is not None else 0
              for kind, w in windows.items()}
    mask = attention_masks(ints[4 * B * T:], pos, visible, cache_len, windows, dtype, starts)
    return PackedStep(ids, pos, depths, parents, visible, mask, [len(r.tokens) for r in rows], starts)


def attention_masks(prefix: torch.Tensor, pos: torch.Tensor, tree_vis: torch.Tensor, cache_len: int,
                    windows: dict[str, int | None], dtype: torch.dtype, starts: dict[str, int] | None = None):
    """Additive masks [B, 1, T, cache_len - start + T] on the inputs' device from ``prefix`` [B], node
    positions ``pos`` [B, T] and ``tree_vis`` [B, T, T] (``starts``: per kind, the first cache column
    covered; default 0): a tensor when the model has one attention kind, else a dict keyed by layer
    type (a single mask would give sliding layers full attention)."""
    starts = starts or {}
    masks = {kind: _additive(prefix, pos, tree_vis, cache_len, window, dtype, starts.get(kind, 0))
             for kind, window in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def _additive(prefix, pos, tree_vis, cache_len: int, window: int | None, dtype: torch.dtype,
              start: int = 0) -> torch.Tensor:
    """One [B, 1, T, cache_len - start + T] mask over cache columns ``start``.. and the step's
    (a node sees its row's committed columns within ``window`` positions and its tree ancestors);
    off CPU a view of rows padded to ``MASK_ALIGN`` columns."""
    B, T = pos.shape
    L = cache_len - start
    W = L + T
    width = W if pos.device.type == "cpu" else -(-W // MASK_ALIGN) * MASK_ALIGN
    out = torch.full((B, T, width), torch.finfo(dtype).min, dtype=dtype, device=pos.device)[..., :W]
    cols = torch.arange(start, cache_len, device=pos.device)  # [L]
    seen = (cols < prefix[:, None])[:, None, :]  # [B, 1, L]
    tree = tree_vis  # [B, T, T]
    if window is not None:
        seen = seen & ((pos[:, :, None] - cols) < window)  # [B, T, L]
        tree = tree & ((pos[:, :, None] - pos[:, None, :]) < window)
    out[:, :, :L].masked_fill_(seen, 0)
    out[:, :, L:].masked_fill_(tree, 0)
    return out[:, None]


def sdpa_aligned(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` [..., T, W] itself when its start and its strides are multiples of ``MASK_ALIGN``
    elements, else a copy in rows padded to ``MASK_ALIGN`` columns (a view). SDPA's memory-efficient
    CUDA kernel checks a bias's strides but not where it starts, and reads it with vector loads: a
    view starting mid-row (one prompt's square of a packed prefill mask) is a misaligned address
    there."""
    strides_ok = all(s % MASK_ALIGN == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if strides_ok and mask.storage_offset() % MASK_ALIGN == 0:
        return mask
    return _padded_copy(mask)


def fold_groups(mask: torch.Tensor, groups: int, aligned: bool | None = None) -> torch.Tensor:
    """``mask`` [B, 1, T, S] for ``groups`` query heads stacked along the queries: [B, 1, groups * T, S].
    ``aligned`` (default: off CPU): in rows padded to ``MASK_ALIGN`` columns (a view), which SDPA's
    memory-efficient kernel reads as they are (a contiguous [.., S] mask it copies again, per layer)."""
    B, _, T, S = mask.shape
    if not (mask.device.type != "cpu" if aligned is None else aligned):
        return mask.expand(B, groups, T, S).reshape(B, 1, groups * T, S)
    return _padded_copy(mask.expand(B, groups, T, S)).view(B, 1, groups * T, S)


def _padded_copy(src: torch.Tensor) -> torch.Tensor:
    """A copy of ``src`` [..., W] in rows padded to ``MASK_ALIGN`` columns (a view of the first W)."""
    W = src.shape[-1]
    return src.new_empty(*src.shape[:-1], -(-W // MASK_ALIGN) * MASK_ALIGN)[..., :W].copy_(src)

