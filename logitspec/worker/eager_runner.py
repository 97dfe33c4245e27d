"""The eager model runner: the target model on packed step rows, its KV storage and its output layer.

Everything between "these rows need verifying" and "here are their logits" lives here: packing
(tokens, positions, tree masks), device moves, selecting the nodes whose outputs are needed and the
output layer (:class:`~logitspec.worker.head.Head`). :class:`EagerRunner` implements
:class:`~logitspec.worker.runner.ModelRunner` with the model's own forward over a
:class:`~logitspec.worker.kv_cache.BatchKV`; the session, the cost calibration and the tensor-parallel code
call the target through it.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from logitspec.device import to_device
from logitspec.worker.head import Head, NodeLogits, OutputMode
from logitspec.worker.kv_cache import BatchKV
from logitspec.worker.masks import PackedStep, StepRow, layer_windows, pack


class ForwardResult:
    """One forward's output-layer results, where they came from, and the time spent packing it.

    ``nodes`` [N, V]: per row its n_b nodes (or only its last node), rows in order; given as the
    results, or as a function that computes them when first asked (a step decided inside its graph
    needs them only if acceptance cannot use the ``decision``). ``decision``: a greedy step's
    acceptance computed with the forward (:func:`~logitspec.sample.acceptance.greedy_decision`,
    [B, 2 + ``decision_top`` + T] int64, on the device), or None."""

    def __init__(self, nodes: NodeLogits | Callable[[], NodeLogits], packed: PackedStep, select: torch.Tensor,
                 starts: torch.Tensor, spans: list[tuple[int, int]], pack_s: float,
                 decision: torch.Tensor | None = None, decision_top: int = 0, decision_ready=None):
        self._nodes = nodes
        self.packed = packed  # the forward's inputs and tree structure, on the model's device
        self.select = select  # int64 [N]: the nodes' flat positions in the [B, T] batch (device)
        self.starts = starts  # int64 [B]: where each row's nodes start in ``nodes`` (device)
        self.spans = spans  # the same ranges on the host
        self.pack_s = pack_s  # masks, positions and node selection, before the model runs
        self.decision, self.decision_top = decision, decision_top
        self.decision_ready = decision_ready  # a CUDA event: ``decision`` (host memory) is filled once it is

    @property
    def nodes(self) -> NodeLogits:
        if callable(self._nodes):
            self._nodes = self._nodes()
        return self._nodes

    @property
    def logits(self) -> list[NodeLogits]:
        """Per row, its nodes' results."""
        return [self.nodes[a:z] for a, z in self.spans]


class EagerRunner:
    """The target model on :class:`~logitspec.worker.masks.StepRow` batches against a :class:`BatchKV`."""

    kind = "eager"  # the runner's name in a stored cost curve's key (calibrate.runner_fingerprint)

    def __init__(self, model, fast_head: bool = True, sharded_head: bool = False):
        """``fast_head=False`` uses the model's own forward for the output layer; ``sharded_head``: the
        output layer is a tensor-parallel module, run on the selected nodes (:class:`Head`)."""
        self.model = model
        self.head = Head(model, fast=fast_head, sharded=sharded_head)
        self.windows = layer_windows(model.config)
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        cfg = model.config.get_text_config(decoder=True)
        kinds = getattr(cfg, "layer_types", None)
        # sliding-window layers attend over their window only (pack's trim), given each layer's kind
        windowed = any(w is not None for w in self.windows.values())
        self.layer_kinds = list(kinds) if kinds and windowed else None
        # per layer, its attention window (None: all columns)
        self._windows_per_layer = ([self.windows[k] for k in kinds] if kinds
                                   else [next(iter(self.windows.values()))] * int(cfg.num_hidden_layers))
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 30))

    def read_columns(self, cached: float) -> float:
        """Cached columns a new node's attention reads, averaged over the layers, with ``cached``
        columns in its row (a sliding-window layer reads at most its window)."""
        w = self._windows_per_layer
        return sum(cached if x is None else min(cached, x) for x in w) / max(len(w), 1)

    def new_batch(self, max_rows: int) -> BatchKV:
        """An empty batch cache of up to ``max_rows`` rows (rows admitted later are written in place)."""
        return BatchKV(max_rows=max_rows)

    def new_row(self, reserve: int = 0) -> BatchKV:
        """An empty one-row cache for a prompt of about ``reserve`` tokens."""
        return BatchKV.empty_row(reserve=reserve)

    def step(self, rows: list[StepRow], kv: BatchKV, mode: OutputMode) -> ForwardResult:
        """One decoding step: every node of every row, output-layer results (``mode``) for all of them."""
        return self(rows, kv, True, mode)

    def __call__(self, rows: list[StepRow], kv: BatchKV, all_logits: bool,
                 mode: OutputMode = OutputMode.EXACT,
                 pick: list[np.ndarray] | None = None, segments: tuple[tuple[int, int], ...] | None = None,
                 prefill: bool = False) -> ForwardResult:
        """One forward over ``rows`` (row b of ``kv`` gains ``len(rows[b].tokens)`` columns plus
        padding); per row, the output layer's results (``mode``) for all its nodes, or its last node
        only, or (``pick``) the nodes ``pick[b]``. ``segments`` (prompts side by side in one row) and
        ``prefill`` (every row a causal chunk): see :mod:`logitspec.worker.attention`. Queues the work on
        the model's device without waiting for it."""
        t0 = time.perf_counter()
        packed = pack(rows, kv.columns, self.windows, self.dtype, self.device,
                      trim=self.layer_kinds is not None)  # masks [B, 1, T, L - start + T]
        T = packed.ids.shape[1]
        if pick is not None:
            sizes = [len(p) for p in pick]
            select = np.concatenate([b * T + np.asarray(p, dtype=np.int64) for b, p in enumerate(pick)])
        else:
            sizes = packed.sizes if all_logits else [1] * len(rows)
            first = [b * T + (0 if all_logits else n - 1) for b, n in enumerate(packed.sizes)]
            # [N] flat node indices
            select = np.concatenate([np.arange(f, f + n) for f, n in zip(first, sizes)])
        starts = np.cumsum([0] + sizes[:-1])  # [B]
        both = to_device(np.concatenate([select, starts]).astype(np.int64), self.device)  # one transfer
        select_d, starts_d = both[:len(select)], both[len(select):]
        pack_s = time.perf_counter() - t0
        if self.layer_kinds is not None:
            kv.attend_from([packed.starts[k] for k in self.layer_kinds])
        try:
            # one row's causal chunk right after its committed columns: a fused causal kernel off CPU
            causal = prefill and not segments and len(rows) == 1 and rows[0].prefix_len == kv.columns
            nodes = self.head(packed.ids, packed.pos, packed.mask, kv.hf, select_d, mode,
                              attn=_attention_keywords(segments, prefill, causal))  # [N, V]
        finally:
            if self.layer_kinds is not None:
                kv.attend_from(None)
        spans = [(int(a), int(a) + n) for a, n in zip(starts, sizes)]
        return ForwardResult(nodes, packed, select_d, starts_d, spans, pack_s)

    def prefill(self, tokens: list[int], chunk: int,
                mode: OutputMode = OutputMode.EXACT) -> tuple[BatchKV, NodeLogits]:
        """A one-row cache holding ``tokens`` (run in causal chunks of ``chunk``), and the output-layer
        result (``mode``) of the last token."""
        row = BatchKV.empty_row(reserve=len(tokens))
        for start in range(0, len(tokens), chunk):
            last = self.extend(row, tokens[start:start + chunk], mode)
        return row, last

    def prefill_rows(self, prompts: list[list[int]],
                     mode: OutputMode = OutputMode.EXACT) -> tuple[BatchKV, list[NodeLogits]]:
        """Prefill several prompts from scratch in one forward (short prompts, back to back in one
        row, each attending only to itself: no padding): a cache whose row b holds prompt b, and
        per prompt the output-layer result of its last token ([1, V])."""
        row = BatchKV.empty_row()
        lengths = [len(p) for p in prompts]
        ends = np.cumsum(lengths) - 1  # each prompt's last node
        segments = tuple((int(e) + 1 - n, int(e) + 1) for e, n in zip(ends, lengths))
        out = self([StepRow.side_by_side(prompts)], row, False, mode, pick=[ends], segments=segments,
                   prefill=True)
        row.commit([list(range(sum(lengths)))])
        return row.split_row(lengths), [out.nodes[i:i + 1] for i in range(len(prompts))]

    def extend(self, row: BatchKV, tokens: list[int], mode: OutputMode = OutputMode.EXACT) -> NodeLogits:
        """Run ``tokens`` as one causal chunk after the committed columns of the one-row cache
        ``row`` and commit them; the output-layer result (``mode``) of the last token ([1, V])."""
        cols = row.columns
        last = self([StepRow.chain(row.lengths[0], tokens)], row, False, mode, prefill=True).logits[0]
        row.commit([list(range(cols, cols + len(tokens)))])
        return last


def _attention_keywords(segments, prefill: bool, causal: bool = False) -> dict:
    """The keywords :mod:`logitspec.worker.attention` reads, those that are set."""
    return {k: v for k, v in (("segments", segments), ("prefill", prefill), ("causal", causal)) if v}
