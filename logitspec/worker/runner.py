"""The model runner seam: what a session needs from the target model, whatever runs it.

A session hands the runner packed rows (:class:`~logitspec.worker.masks.StepRow`: tokens, tree parents,
positions) and gets the nodes' output-layer results (:class:`~logitspec.worker.head.NodeLogits`, in the
:class:`~logitspec.worker.head.OutputMode` the rows need); the runner also owns the KV storage (it makes
the batch's cache and each prompt's prefill row) and the output layer. The eager CPU/GPU runner is
:class:`~logitspec.worker.eager_runner.EagerRunner`; a CUDA graph runner over static slots, or a
tensor-parallel group wrapping either, implements the same protocol.

The KV objects a runner returns are used by the session through their own small interface
(``columns``, ``commit``, ``keep_rows``, ``add_row``, ``add_rows``, ``rows``: see
:class:`~logitspec.worker.kv_cache.BatchKV`).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from logitspec.worker.head import NodeLogits, OutputMode
from logitspec.worker.masks import StepRow


class ModelRunner(Protocol):
    """The target model behind one interface (see the module)."""

    device: torch.device  # where the logits are
    max_context: int  # the model's context length

    def new_batch(self, max_rows: int) -> Any:
        """An empty batch cache for up to ``max_rows`` decoding rows."""
        ...

    def new_row(self, reserve: int = 0) -> Any:
        """An empty one-row cache for a prompt of about ``reserve`` tokens (filled by :meth:`extend`)."""
        ...

    def prefill_rows(self, prompts: list[list[int]], mode: OutputMode) -> tuple[Any, list[NodeLogits]]:
        """Prefill several short prompts from scratch in one forward: a cache whose row b holds prompt
        b (``split_row`` of one row), and per prompt its last token's output ([1, V])."""
        ...

    def extend(self, row: Any, tokens: list[int], mode: OutputMode) -> NodeLogits:
        """Run ``tokens`` as one causal chunk after the one-row cache ``row`` and commit them; the
        last token's output ([1, V])."""
        ...

    def step(self, rows: list[StepRow], kv: Any, mode: OutputMode):
        """One decoding step over packed rows (row b of ``kv`` is ``rows[b]``'s; its nodes' columns
        are added, uncommitted): a :class:`~logitspec.worker.eager_runner.ForwardResult` with every node's
        output
        (``nodes``, per-row ``logits`` and ``spans``) and the packed step (``packed``, ``select``,
        ``starts``) that :func:`~logitspec.sample.acceptance.decide` reads. May return before the device is
        done."""
        ...

    def read_columns(self, cached: float) -> float:
        """Cached columns a new node's attention reads, averaged over layers, with ``cached`` columns
        in its row (a sliding-window layer reads at most its window): the cost curve's input."""
        ...
