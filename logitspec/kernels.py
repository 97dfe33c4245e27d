"""Optional CPU kernels for skinny matmuls (a few new tokens per step).

On this project's CPU target, ``F.linear(x, W)`` with a handful of rows ran several times slower
than the same product computed as ``W @ x.T`` (docs/performance.md). ``use_mm_linears`` swaps a
model's ``nn.Linear`` modules for :class:`MMLinear`, which shares the same weight tensors and only
changes how the product is computed (results equal up to float rounding). Opt-in: ``ar`` and the
speculative methods then run the same kernels, so comparisons stay fair.
``logitspec.skinny`` (``use_skinny_linears``) is the compiled AVX2 alternative; both swap modules
with :func:`swap_linears`.
"""
from __future__ import annotations

import torch
from torch import nn


class MMLinear(nn.Linear):
    """``nn.Linear`` computing ``(W @ x.T).T`` for up to ``max_rows`` rows, ``F.linear`` beyond."""

    max_rows: int = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > self.max_rows:
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).T).T  # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().reshape(*x.shape[:-1], self.out_features)


def swap_linears(model: nn.Module, cls: type[nn.Linear], max_rows: int, skip_weights=()) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` by an instance of ``cls`` (an ``nn.Linear``
    subclass with a ``max_rows`` attribute) holding the same weight and bias tensors, not copies.
    Modules whose weight is one of ``skip_weights`` (by identity) are left alone. Returns the count."""
    skip = {id(w) for w in skip_weights}
    swaps = []
    for name, mod in model.named_modules():
        for child_name, child in mod.named_children():
            if type(child) is nn.Linear and id(child.weight) not in skip:
                swaps.append((mod, child_name, child))
    for parent, child_name, old in swaps:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = old.in_features, old.out_features
        new.weight, new.bias = old.weight, old.bias
        new.max_rows = max_rows
        setattr(parent, child_name, new)
    return len(swaps)


def use_mm_linears(model: nn.Module, max_rows: int = 64) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` (weights shared, not copied); returns the count."""
    return swap_linears(model, MMLinear, max_rows)
