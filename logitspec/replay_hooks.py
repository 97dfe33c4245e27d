"""What an :class:`~logitspec.engine.Engine` takes in place of its defaults to record or replay
acceptance traces (:mod:`logitspec.trace`, :mod:`logitspec.replay`). Every field None: the normal path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .drafter import Drafter
from .tree import DraftTree


@dataclass(frozen=True)
class ReplayHooks:
    """Collaborators handed to the engine at construction (see :mod:`logitspec.replay`)."""

    drafter: Drafter | None = None  # the policy's drafter instead of the method's
    # per row of a step, the node to accept instead of the greedy rule's (replayed acceptance)
    forced_last: Callable[[Sequence[DraftTree]], list[int]] | None = None
    # after each decoding step: (rows, trees, accepted paths), e.g. a trace.TraceRecorder
    step_observer: Callable[[Sequence[Any], Sequence[DraftTree], Sequence[Sequence[int]]], None] | None = None
    eos_ids: frozenset[int] | None = None  # token ids that end a sequence instead of the model's
