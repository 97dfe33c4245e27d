"""Batched KV cache: one row per active sequence, rows left-aligned (column = position).

The only module that touches cache tensors. It wraps a ``transformers.DynamicCache`` built without a
config, so every layer (sliding-window ones too) is a plain ``DynamicLayer`` that keeps all columns:
sliding windows are enforced by the masks (``masks.py``), never by eviction, which makes rolling back
rejected draft nodes safe after the window has wrapped (shared/FINDINGS.md).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class BatchKV:
    """Rows of committed KV entries; ``lengths[b]`` columns of row b are valid."""

    def __init__(self) -> None:
        self.hf = DynamicCache()
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        """Columns held (committed entries of the longest row, plus holes of the others)."""
        # not hf.get_seq_length(): it reads 0 for a layer with zero KV heads (a tensor-parallel rank
        # that holds no attention head, e.g. Gemma 3's single KV head under AutoTP)
        return next((layer.keys.shape[2] for layer in self._layers()), 0) if self.rows else 0

    def _layers(self):
        for layer in self.hf.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(f"unsupported cache layer {type(layer).__name__}; BatchKV needs DynamicLayer")
            if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:  # [rows, heads, cols, dim]
                yield layer

    def commit(self, src_cols: list[list[int]]) -> None:
        """After a step appended ``T`` columns, keep for row b the columns ``src_cols[b]`` (ascending,
        absolute) right after its committed ones, and drop every other new column and hole past
        the longest row."""
        b_idx, src, dst = [], [], []
        for b, cols in enumerate(src_cols):
            start = self.lengths[b]
            for i, c in enumerate(cols):
                if c != start + i:
                    b_idx.append(b)
                    src.append(c)
                    dst.append(start + i)
            self.lengths[b] += len(cols)
        keep = max(self.lengths)
        if b_idx:
            bi, s, d = (torch.tensor(x) for x in (b_idx, src, dst))
        for layer in self._layers():
            for name in ("keys", "values"):
                t = getattr(layer, name)  # [rows, heads, columns, head_dim]
                if b_idx:
                    t[bi, :, d] = t[bi, :, s]
                setattr(layer, name, t[:, :, :keep])

    def keep_rows(self, rows: list[int]) -> None:
        """Release every row not in ``rows`` (finished sequences)."""
        if rows == list(range(self.rows)):
            return
        self.lengths = [self.lengths[r] for r in rows]
        if not rows:
            self.hf = DynamicCache()
            return
        idx = torch.tensor(rows)
        keep = max(self.lengths)
        for layer in self._layers():
            layer.keys = layer.keys[idx, :, :keep].contiguous()
            layer.values = layer.values[idx, :, :keep].contiguous()

    def add_row(self, other: "BatchKV") -> None:
        """Append the single row of ``other`` (a freshly prefilled sequence) as the last row."""
        assert other.rows == 1
        if self.rows == 0:
            self.hf, self.lengths = other.hf, list(other.lengths)
            return
        width = max(self.columns, other.columns)
        for mine, theirs in zip(self._layers(), other._layers()):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = _pad_columns(a, width)
                b = _pad_columns(b, width)
                setattr(mine, name, torch.cat([a, b], dim=0))
        self.lengths.append(other.lengths[0])


def _pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad [rows, heads, columns, dim] along columns to ``width``."""
    if t.shape[2] >= width:
        return t
    pad = t.new_zeros(t.shape[0], t.shape[1], width - t.shape[2], t.shape[3])
    return torch.cat([t, pad], dim=2)
