"""The one seam to the target model: run it on packed step rows and return output-layer results.

Everything between "these rows need verifying" and "here are their logits" lives here: packing
(tokens, positions, tree masks), device moves, selecting the nodes whose outputs are needed and the
output layer (:class:`~logitspec.head.Head`). The engine, the cost calibration, the profiling script
and the tensor-parallel code all call the target through :class:`TargetForward`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import BatchKV
from .head import Head, NodeLogits
from .masks import StepRow, layer_windows, pack_step


@dataclass
class ForwardResult:
    """One forward's output-layer results and the time spent packing it."""

    logits: list[NodeLogits]  # per row: its n_b nodes (or only its last node), in row order
    pack_s: float  # masks, positions and node selection, before the model runs


class TargetForward:
    """The target model on :class:`~logitspec.masks.StepRow` batches against a :class:`BatchKV`."""

    def __init__(self, model, fast_head: bool = True):
        """``fast_head=False`` uses the model's own forward for the output layer (needed when the
        output layer is sharded, e.g. DeepSpeed AutoTP)."""
        self.model = model
        self.head = Head(model, fast=fast_head)
        self.windows = layer_windows(model.config)
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        cfg = model.config.get_text_config(decoder=True)
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))

    def __call__(self, rows: list[StepRow], kv: BatchKV, all_logits: bool, exact: bool = True) -> ForwardResult:
        """One forward over ``rows`` (row b of ``kv`` gains ``len(rows[b].tokens)`` columns plus
        padding); per row, the output layer's results for all its nodes, or its last node only.
        ``exact=False`` allows screened scores (greedy: exact argmax, approximate scores)."""
        t0 = time.perf_counter()
        ids, pos, mask = pack_step(rows, kv.columns, self.windows, self.dtype)  # [B, T], [B, T], [B, 1, T, L + T]
        if isinstance(mask, dict):
            mask = {k: v.to(self.device) for k, v in mask.items()}
        else:
            mask = mask.to(self.device)
        T = ids.shape[1]
        spans = [(b * T, b * T + len(r.tokens)) if all_logits else (b * T + len(r.tokens) - 1, b * T + len(r.tokens))
                 for b, r in enumerate(rows)]
        select = torch.cat([torch.arange(a, z) for a, z in spans]).to(self.device)  # [N] flat node indices
        pack_s = time.perf_counter() - t0
        logits = self.head(ids.to(self.device), pos.to(self.device), mask, kv.hf, select, exact=exact)  # N nodes
        out, start = [], 0
        for a, z in spans:
            out.append(logits[start:start + z - a])
            start += z - a
        return ForwardResult(out, pack_s)

    def prefill(self, tokens: list[int], chunk: int, exact: bool = True) -> tuple[BatchKV, NodeLogits]:
        """A one-row cache holding ``tokens`` (run in causal chunks of ``chunk``), and the output-layer
        result of the last token."""
        row = BatchKV.empty_row()
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            cols = row.columns
            last = self([StepRow.chain(start, part)], row, all_logits=False, exact=exact).logits[0]
            row.commit([list(range(cols, cols + len(part)))])
        return row, last
