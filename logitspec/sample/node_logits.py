"""What the output layer computes for a forward's nodes (:class:`OutputMode`) and its results
(:class:`NodeLogits`): the output layer's interface to acceptance and sampling. :mod:`logitspec.worker.head`
makes them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable

import torch

__all__ = ["NodeLogits", "OutputMode"]


class OutputMode(enum.Enum):
    """What the output layer computes for a forward's nodes.

    ``GREEDY``: the exact float32 argmax of every node; scores approximate (ranking only: the
    next-next guesses). ``SCREENED``: float32 screened scores and what an exact draw from them needs
    (:meth:`NodeLogits.sample`); the argmax only where asked. ``EXACT``: float32 logits of every
    node (sampling where the logits are). Where the head has no screen (a GPU, soft-capped logits,
    a sharded output layer) every mode gives float32 rows."""

    GREEDY = 1
    SCREENED = 2
    EXACT = 3

    @classmethod
    def for_rows(cls, modes: Iterable["OutputMode"]) -> "OutputMode":
        """The one mode that serves rows needing ``modes`` together (GREEDY for none)."""
        return max(modes, key=lambda m: m.value, default=cls.GREEDY)


@dataclass
class NodeLogits:
    """Output-layer results for the N selected nodes of one forward: the output layer's interface to
    acceptance. ``argmax`` is the greedy choice of every node, :meth:`sample` an exact draw at one
    node, ``scores`` rank tokens (the next-next guesses; float32 logits when ``exact``). Screened
    results keep the nodes' hidden states and the screen, so that exact float32 values are computed
    later, only for the nodes that need them."""

    # [N, V]: float32 logits if ``exact``, else approximations for ranking only (bfloat16 when the
    # greedy screen's bfloat16 pass made them)
    scores: torch.Tensor
    exact: bool
    screened_argmax: torch.Tensor | None = None  # [N] int64: the exact argmax, once known
    hidden: torch.Tensor | None = None  # [N, H] float32: the nodes' hidden states, where a screen serves them
    screen: Any = None  # the screen that can rescore them (a logitspec.worker.head.ScreenedArgmax)

    @property
    def argmax(self) -> torch.Tensor:
        """[N] int64: the float32 argmax token of each node (the greedy choice); computed when first
        asked (sampling never asks)."""
        if self.screened_argmax is None and self.screen is not None:
            self.screened_argmax = self.screen.exact_argmax(self.scores, self.hidden)
        return self.screened_argmax if self.screened_argmax is not None else self.scores.argmax(dim=-1)

    def __getitem__(self, rows) -> "NodeLogits":
        """The results of ``rows`` (a slice or an index tensor)."""
        arg = self.screened_argmax[rows] if self.screened_argmax is not None else None
        hidden = self.hidden[rows] if self.hidden is not None else None
        return NodeLogits(self.scores[rows], self.exact, arg, hidden, self.screen)
