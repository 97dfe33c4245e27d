"""A decoder layer's projections of one input computed as one GEMM: query, key and value, and the
MLP's gate and up.

transformers' decoders call ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``)
one after the other on the same hidden states. :func:`merge_projections` concatenates each such
group's weights (and biases) once, at load, into one matrix whose rows the parts' weights then view
(no second copy), and puts a :class:`MergedPart` in each part's place. The first part called with an
input computes the whole product (one GEMM) and keeps it; the others, called with the same tensor,
return their columns of it; the last one drops it. A part called with another input while the product
is kept computes its own product from its view; a part called again starts a new product. So outputs
never depend on the order in which a model calls its parts. A merged model is for inference: its
``state_dict`` names the merged weights, not the parts' (save the model before merging).

On a GPU a decode step of a few rows reads the weights once either way; merging removes two GEMM
launches per attention and one per MLP (3 of 7 per Llama layer), and the key and value projections,
a quarter of the query's width under grouped-query attention, no longer run as GEMMs too narrow to
fill the device. vLLM and gpt-fast load their weights merged the same way (``QKVParallelLinear``,
``MergedColumnParallelLinear``; gpt-fast's ``wqkv``). Inside a compiled step dynamo traces the
parts like any module: the step holds one GEMM per group (tests/test_merged_projections.py reads
inductor's generated code).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# the groups merged where a module holds every part as a plain nn.Linear of one input
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedProduct(nn.Module):
    """The concatenated weight [sum(out), in] (and bias) of a group, and the product of its last input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, widths: list[int]):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.widths = widths
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()  # the last input's product, split by part
        self.served = 0  # bit i: part i has read it

    def part(self, x: torch.Tensor, index: int, rows: slice) -> torch.Tensor:
        """Part ``index``'s product of ``x`` [..., in] -> [..., widths[index]] (``rows``: its rows of
        the merged weight)."""
        bit = 1 << index
        if self.input is not None and self.input is not x and not self.served & bit:
            bias = None if self.bias is None else self.bias[rows]  # another input: this part's own
            return F.linear(x, self.weight[rows], bias)
        if self.input is not x or self.served & bit:  # none kept, or this part read it: a new product
            self.input, self.served = x, 0
            self.parts = F.linear(x, self.weight, self.bias).split(self.widths, dim=-1)
        out = self.parts[index]
        self.served |= bit
        if self.served == (1 << len(self.widths)) - 1:  # every part has read it: nothing kept
            self.input, self.parts, self.served = None, (), 0
        return out


class MergedPart(nn.Module):
    """One projection of a merged group: ``weight`` and ``bias`` are views of the group's."""

    def __init__(self, merged: MergedProduct, index: int, offset: int):
        super().__init__()
        self.merged, self.index = merged, index
        self.in_features, self.out_features = merged.weight.shape[1], merged.widths[index]
        self.rows = slice(offset, offset + self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.merged.weight[self.rows]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.merged.bias is None else self.merged.bias[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged.part(x, self.index, self.rows)


def _mergeable(parts: list) -> bool:
    first = parts[0]
    return (all(type(p) is nn.Linear for p in parts)
            and len({(p.in_features, p.weight.dtype, p.weight.device, p.bias is None) for p in parts}) == 1
            and first.weight.device.type != "meta")


@torch.no_grad()
def merge_projections(model: nn.Module, groups=GROUPS) -> int:
    """Merge every group of ``groups`` (attribute names) that a module of ``model`` holds as plain
    ``nn.Linear`` parts of one input size, dtype and device; returns the groups merged. Run it after
    the model is on its device and before anything shards its linears (a tensor-parallel shard's
    linears are not plain ``nn.Linear`` and are left alone)."""
    merged = 0
    for module in list(model.modules()):
        for names in groups:
            parts = [getattr(module, n, None) for n in names]
            if any(p is None for p in parts) or not _mergeable(parts):
                continue
            widths = [p.out_features for p in parts]
            weight = torch.cat([p.weight for p in parts])  # [sum(widths), in]
            bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
            product = MergedProduct(weight, bias, widths)
            offset = 0
            for i, name in enumerate(names):
                setattr(module, name, MergedPart(product, i, offset))
                offset += widths[i]
            merged += 1
    return merged
