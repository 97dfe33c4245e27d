"""Pack per-sequence draft trees into one forward: tokens, positions and 4D attention masks.

Layout of the KV columns seen by a step (``L`` cached columns + ``T`` new ones):
row b's committed tokens are columns ``[0, prefix_len[b])`` (position = column), columns
``[prefix_len[b], L)`` are holes, and the new tree nodes are columns ``L + i``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .tree import DraftTree

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class StepRow:
    """One sequence's part of a step: ``tokens`` placed at positions ``prefix_len + depths``."""

    prefix_len: int
    tokens: np.ndarray  # int64 [n]
    depths: np.ndarray  # int64 [n]
    visible: np.ndarray  # bool [n, n]: node i attends to node j

    @classmethod
    def from_tree(cls, prefix_len: int, tree: DraftTree) -> "StepRow":
        return cls(prefix_len, tree.tokens, tree.depths, tree.ancestor_mask())

    @classmethod
    def chain(cls, prefix_len: int, tokens) -> "StepRow":
        """A causal chunk of ``tokens`` (prefill)."""
        n = len(tokens)
        return cls(prefix_len, np.asarray(tokens, dtype=np.int64), np.arange(n, dtype=np.int64),
                   np.tril(np.ones((n, n), dtype=bool)))


def layer_windows(config) -> dict[str, int | None]:
    """Attention kinds used by the model's layers -> sliding window (None for full attention)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(cfg, "layer_types", None) or [FULL])
    unknown = kinds - {FULL, SLIDING}
    if unknown:
        raise NotImplementedError(f"unsupported attention layer types: {sorted(unknown)}")
    return {k: (cfg.sliding_window if k == SLIDING else None) for k in sorted(kinds)}


def pack_step(rows: list[StepRow], cache_len: int, windows: dict[str, int | None], dtype: torch.dtype):
    """Returns ``input_ids`` [B, T], ``position_ids`` [B, T] and the additive float mask(s)
    [B, 1, T, cache_len + T]: a tensor when the model has one attention kind, else a dict keyed by
    layer type (a single mask would give sliding layers full attention). Padding nodes see only
    themselves and their outputs are ignored."""
    B, T = len(rows), max(len(r.tokens) for r in rows)
    ids = np.zeros((B, T), dtype=np.int64)
    q_pos = np.zeros((B, T), dtype=np.int64)
    tree_vis = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T)).copy()
    prefix = np.zeros(B, dtype=np.int64)
    for b, r in enumerate(rows):
        n = len(r.tokens)
        ids[b, :n] = r.tokens
        q_pos[b, :n] = r.prefix_len + r.depths
        tree_vis[b, :n, :n] = r.visible
        prefix[b] = r.prefix_len
    cols = np.arange(cache_len)
    prefix_vis = np.broadcast_to(cols[None, None, :] < prefix[:, None, None], (B, T, cache_len))
    vis = torch.from_numpy(np.concatenate([prefix_vis, tree_vis], axis=2))  # [B, T, L + T]
    kv_pos = torch.from_numpy(np.concatenate([np.broadcast_to(cols, (B, cache_len)), q_pos], axis=1))
    q = torch.from_numpy(q_pos)
    neg = torch.finfo(dtype).min
    masks = {}
    for kind, window in windows.items():
        v = vis if window is None else vis & ((q[:, :, None] - kv_pos[:, None, :]) < window)
        masks[kind] = torch.zeros(v.shape, dtype=dtype).masked_fill_(~v, neg)[:, None]
    mask = next(iter(masks.values())) if len(masks) == 1 else masks
    return torch.from_numpy(ids), q, mask
