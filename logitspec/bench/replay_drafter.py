"""Replayed acceptance: the engine decodes with the trees and accepted lengths of a recorded trace.

A trace (:mod:`logitspec.bench.trace`) holds, per row and decoding step, the shape of the tree a real model's
run verified and the node it accepted. Replaying it runs the whole engine (session, batching, the
model runner's forward over every tree, the KV commit, masks, the acceptance transfer) on another
model, typically random weights of a real shape, through two seams given at construction
(:class:`ReplayHooks`):

- :class:`ReplayDrafter`: each row's next recorded tree shape (its nodes carry the root's token). It
  first runs the method's own drafter on the row and discards its tree, so drafting's host time is
  paid as in a real run (on the replay's context, not the recorded text);
- :func:`recorded_last`: the acceptance override; the step's acceptance runs as usual on the device
  (the same work and one transfer), but keeps the recorded node, and the bonus token is the target's
  argmax there.

EOS ends no replayed row (its length is the recorded one). Replay is greedy only, and the trees are
those the recording run's budget chose (at its batch size, on its machine): the replay measures what
that acceptance costs on another model and machine, not what this machine's budget would choose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from logitspec.bench.trace import Trace, TraceSequence
from logitspec.config import SpecConfig
from logitspec.engine.request import Request
from logitspec.spec_decode.drafters import make_drafter
from logitspec.spec_decode.interface import KIND, Drafter
from logitspec.spec_decode.tree import DraftTree

REPLAYED = "replayed acceptance"  # the label of every replayed figure


@dataclass(frozen=True)
class ReplayHooks:
    """What an :class:`~logitspec.engine.Engine` takes in place of its defaults to record or replay
    acceptance traces (every field None: the normal path); pass them as ``Engine(..., **hooks.kwargs())``."""

    drafter: Drafter | None = None  # the policy's drafter instead of the method's
    accept_override: Callable[[Sequence[DraftTree]], list[int]] | None = None  # per row, the node to accept
    step_observer: Callable[..., None] | None = None  # after each step: (rows, trees, paths), a TraceRecorder
    eos_ids: frozenset[int] | None = None  # token ids that end a sequence instead of the model's

    def kwargs(self) -> dict[str, Any]:
        return {"drafter": self.drafter, "accept_override": self.accept_override,
                "step_observer": self.step_observer, "eos_ids": self.eos_ids}


@dataclass(frozen=True)
class ReplayTree(DraftTree):
    """A recorded tree shape and the node its recording accepted."""

    accepted: int = 0


@dataclass
class Cursor:
    """A replayed row's state: its recorded sequence and the next step."""

    sequence: TraceSequence
    step: int = 0


class ReplayDrafter(Drafter):
    """Trees of the recorded shapes, row by row (see the module); rows are matched to recorded
    sequences by their prompt."""

    keeps_state = True
    fixed_shape = True  # the recorded tree, whatever the batch

    def __init__(self, config: SpecConfig, by_prompt: dict[tuple[int, ...], TraceSequence],
                 inner: Drafter | None = None):
        """``by_prompt``: each replayed prompt's recorded sequence; ``inner``: the method's drafter
        (default :func:`~logitspec.spec_decode.drafters.make_drafter`), run for its host time only."""
        super().__init__(config)
        self.by_prompt = by_prompt
        self.inner = make_drafter(config) if inner is None else inner
        self.wants_guesses = self.inner.wants_guesses  # the step computes the guesses' top-k as the method's
        self.most = max((len(p) - 1 for s in by_prompt.values() for p in s.parents), default=0)

    def base_budget(self) -> int:
        return self.most

    def new_state(self, prompt: Sequence[int]) -> Cursor:
        seq = self.by_prompt.get(tuple(int(t) for t in prompt))
        if seq is None:
            raise ValueError(f"replay: a prompt of {len(prompt)} tokens that no recorded sequence has")
        return Cursor(seq)

    def draft(self, sources, context, guesses, budget: int, state: Any = None) -> ReplayTree:
        self.inner.draft(sources, context, guesses, min(budget, self.inner.base_budget()), None)
        seq, step = state.sequence, state.step
        if step >= len(seq.last):
            raise ValueError(f"replay: sequence {seq.id!r} has {len(seq.last)} recorded steps; the row "
                             "asked for more")
        parents = np.asarray(seq.parents[step], dtype=np.int64)
        if len(parents) - 1 > budget:
            raise ValueError(f"replay: sequence {seq.id!r}, step {step}: a tree of {len(parents) - 1} draft "
                             f"nodes; the replay's context leaves room for {budget}")
        state.step += 1
        tree = seq.tree(step, context[-1])
        kinds = np.where(parents >= 0, KIND["lookup"], 0).astype(np.int64)
        return ReplayTree(tree.tokens, parents, retrieved=len(parents) > 1, kinds=kinds,
                          offsets=np.maximum(tree.depths - 1, 0), accepted=seq.last[step])


def recorded_last(trees: Sequence[DraftTree]) -> list[int]:
    """The acceptance override: each tree's recorded accepted node."""
    if not all(isinstance(t, ReplayTree) for t in trees):
        raise ValueError("replayed acceptance needs the ReplayDrafter's trees (a budget pruned them?)")
    return [t.accepted for t in trees]


def check_fits(trace: Trace, max_context: int, max_prompt_tokens: int | None = None) -> None:
    """ValueError unless every recorded row fits a model of context ``max_context``: its prompt and
    new tokens, and at every step the row's tokens so far and its tree."""
    for s in trace.sequences:
        prompt = min(s.prompt_tokens, max_prompt_tokens or s.prompt_tokens)
        done = np.cumsum(s.emitted[:-1]) + prompt  # [steps]: the row's tokens before each step
        need = max([prompt + s.new_tokens] + [int(n) + len(p) for n, p in zip(done, s.parents)])
        if need > max_context:
            raise ValueError(f"trace {trace.name} ({trace.method}): sequence {s.id!r} needs {need} positions "
                             f"({prompt} prompt, {s.new_tokens} new, its trees); the replay model's context "
                             f"is {max_context}")


def replay_prompts(sequences: Sequence[TraceSequence], vocab: int, seed: int = 0,
                   max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Random token-id prompts of the recorded lengths (cut to ``max_prompt_tokens``), one per sequence,
    distinct per sequence and the same for every method (seeded by ``seed`` and the index)."""
    out = []
    for i, s in enumerate(sequences):
        n = min(s.prompt_tokens, max_prompt_tokens or s.prompt_tokens)
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        out.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


def replay_plan(trace: Trace, rows: int, vocab: int, seed: int = 0, max_prompt_tokens: int | None = None
                ) -> tuple[list[list[int]], list[Request], list[TraceSequence]]:
    """What a replay runs: ``max(rows, sequences)`` prompts (the recorded sequences repeated to fill
    ``rows``), each with a request for its recorded number of new tokens (greedy), and its sequence."""
    prompts = replay_prompts(trace.sequences, vocab, seed, max_prompt_tokens)
    n = len(trace.sequences)
    pick = [i % n for i in range(max(rows, n))]
    return ([prompts[i] for i in pick], [Request(max_new_tokens=trace.sequences[i].new_tokens) for i in pick],
            [trace.sequences[i] for i in pick])


def replay_config(method: str, batch_size: int) -> SpecConfig:
    """The engine's config for replaying ``method``: the recorded trees are not pruned again."""
    return SpecConfig(method=method, max_batch_size=batch_size, budget="fixed")


def replay_hooks(trace: Trace | None, config: SpecConfig, prompts: Sequence[Sequence[int]],
                 sequences: Sequence[TraceSequence] = ()) -> ReplayHooks:
    """The engine's hooks: with a trace, its trees and accepted nodes (``prompts[i]`` replays
    ``sequences[i]``); without (``ar``), the plain path. EOS ends no row either way."""
    if trace is None:
        return ReplayHooks(eos_ids=frozenset())
    drafter = ReplayDrafter(config, {tuple(p): s for p, s in zip(prompts, sequences)})
    return ReplayHooks(drafter=drafter, accept_override=recorded_last, eos_ids=frozenset())
