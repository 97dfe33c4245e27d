"""Swapping a model's ``nn.Linear`` modules for a subclass that computes the same product another way.

``logitspec.kernels.skinny.use_skinny_linears`` uses :func:`swap_linears` to put its compiled few-row
kernel in a model's decoder.
"""
from __future__ import annotations

from torch import nn


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
