"""Acceptance traces: per decoding step and row, the verified tree's shape and the accepted node.

A :class:`Trace` is recorded by running the real engine with a real model (:class:`TraceRecorder`,
an engine's ``step_observer``) and replayed by
:mod:`logitspec.bench.replay_drafter` on another model (random weights of a real shape), so that the engine's
time per token can be measured with the real model's acceptance where its weights cannot go.

File format (JSON, gzip-compressed when the name ends in ``.gz``): ``format`` (:data:`FORMAT`),
``label``, ``model``, ``method``, ``dataset``, ``batch_size``, ``max_new_tokens``, ``meta`` (free
form: command, date, code version, settings) and ``sequences``, each with ``id``, ``prompt_tokens``,
``emitted`` (tokens emitted per forward, the prefill's first token first; sums to the new tokens),
``parents`` (per decoding step the verified tree's parent array, root -1) and ``last`` (per decoding
step the deepest accepted node; the accepted draft length is its depth).
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from logitspec.spec_decode.tree import DraftTree

FORMAT = "logitspec-trace/1"
LABEL = "acceptance trace"


@dataclass(frozen=True)
class TraceSequence:
    """One recorded row: its prompt length and, per decoding step, the tree's parents and accepted node."""

    id: str
    prompt_tokens: int
    emitted: tuple[int, ...]  # [steps + 1]: tokens per forward, the prefill's first token first
    parents: tuple[tuple[int, ...], ...]  # [steps][nodes]: parent of each node, -1 for the root
    last: tuple[int, ...]  # [steps]: the deepest accepted node

    @property
    def new_tokens(self) -> int:
        return sum(self.emitted)

    def tree(self, step: int, root_token: int) -> DraftTree:
        """Step ``step``'s tree shape, every node carrying ``root_token``."""
        parents = np.asarray(self.parents[step], dtype=np.int64)
        return DraftTree(np.full(len(parents), int(root_token), dtype=np.int64), parents)

    def check(self) -> None:
        """ValueError unless the steps are consistent (shapes, accepted nodes, emitted counts)."""
        where = f"sequence {self.id!r}"
        if len(self.parents) != len(self.last) or len(self.emitted) != len(self.last) + 1:
            raise ValueError(f"{where}: {len(self.parents)} trees, {len(self.last)} accepted nodes and "
                             f"{len(self.emitted)} forwards (need steps, steps, steps + 1)")
        if self.prompt_tokens < 1:
            raise ValueError(f"{where}: prompt_tokens must be >= 1")
        for i, (parents, last) in enumerate(zip(self.parents, self.last)):
            tree = DraftTree(np.zeros(len(parents), dtype=np.int64), np.asarray(parents, dtype=np.int64))
            if not 0 <= last < len(tree):
                raise ValueError(f"{where}, step {i}: accepted node {last} outside a tree of {len(tree)}")
            full = int(tree.depths[last]) + 1  # accepted drafts and the bonus token
            final = i == len(self.last) - 1
            if self.emitted[i + 1] > full or (not final and self.emitted[i + 1] != full):
                raise ValueError(f"{where}, step {i}: {self.emitted[i + 1]} tokens emitted, the accepted "
                                 f"path gives {full}")


@dataclass(frozen=True)
class Trace:
    """The rows of one recorded run of one method (see the module for the file format)."""

    model: str
    method: str
    dataset: str
    batch_size: int
    max_new_tokens: int
    sequences: tuple[TraceSequence, ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        """What traces of several methods on the same prompts share: ``model/dataset``."""
        return f"{self.model}/{self.dataset}"

    @property
    def mat(self) -> float:
        """Mean accepted tokens per forward, pooled over rows (the prefill's forward included)."""
        forwards = sum(len(s.emitted) for s in self.sequences)
        return sum(s.new_tokens for s in self.sequences) / forwards if forwards else 0.0

    @property
    def max_nodes(self) -> int:
        """The largest tree's node count (root included)."""
        return max((len(p) for s in self.sequences for p in s.parents), default=1)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "label": LABEL, "model": self.model, "method": self.method,
                "dataset": self.dataset, "batch_size": self.batch_size, "max_new_tokens": self.max_new_tokens,
                "mat": round(self.mat, 4), "meta": self.meta,
                "sequences": [{"id": s.id, "prompt_tokens": s.prompt_tokens, "emitted": list(s.emitted),
                               "parents": [list(p) for p in s.parents], "last": list(s.last)}
                              for s in self.sequences]}

    @classmethod
    def from_dict(cls, obj: dict[str, Any], where: str = "trace") -> "Trace":
        """The trace in ``obj``; ValueError naming ``where`` if it is not a consistent trace."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"{where}: not a {FORMAT} file")
        try:
            seqs = tuple(TraceSequence(str(s["id"]), int(s["prompt_tokens"]), tuple(map(int, s["emitted"])),
                                       tuple(tuple(map(int, p)) for p in s["parents"]),
                                       tuple(map(int, s["last"])))
                         for s in obj["sequences"])
            trace = cls(str(obj["model"]), str(obj["method"]), str(obj["dataset"]), int(obj["batch_size"]),
                        int(obj["max_new_tokens"]), seqs, dict(obj.get("meta") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed trace ({e!r})") from None
        for s in seqs:
            try:
                s.check()
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        return trace

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write the trace (gzip-compressed if ``path`` ends in ``.gz``); the path."""
        path = pathlib.Path(path)
        text = json.dumps(self.to_dict(), separators=(",", ":")) + "\n"
        if path.suffix == ".gz":
            path.write_bytes(gzip.compress(text.encode(), mtime=0))
        else:
            path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        path = pathlib.Path(path)
        raw = path.read_bytes()
        text = gzip.decompress(raw) if path.suffix == ".gz" else raw
        return cls.from_dict(json.loads(text), str(path))


def load_traces(paths: Iterable[str | os.PathLike] | str | os.PathLike) -> list[Trace]:
    """Traces from files and directories (every ``*.json`` / ``*.json.gz`` in them, sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        files += sorted(p.glob("*.json*")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"no trace files in {[str(p) for p in paths]}")
    return [Trace.load(f) for f in files]


class TraceRecorder:
    """A step observer (an engine's ``step_observer``): each row's trees and accepted nodes."""

    def __init__(self) -> None:
        self.rows: dict[Any, tuple[list, list]] = {}  # row key -> (parents per step, last per step)

    def __call__(self, rows: Sequence[Any], trees: Sequence[DraftTree],
                 paths: Sequence[Sequence[int]]) -> None:
        for row, tree, path in zip(rows, trees, paths):
            parents, last = self.rows.setdefault(row.key, ([], []))
            parents.append(tuple(int(p) for p in tree.parents))
            last.append(int(path[-1]))

    def take(self, results: Sequence[Any], ids: Sequence[str]) -> list[TraceSequence]:
        """The recorded rows of ``results`` (:class:`~logitspec.engine.sequence.GenerationResult`, one sample
        per prompt), named by ``ids``; the recorder is then empty."""
        out = []
        for r, name in zip(results, ids):
            parents, last = self.rows.get((r.request_id, r.sample_index), ([], []))
            seq = TraceSequence(name, len(r.prompt_token_ids), tuple(r.stats["accepted_lengths"]),
                                tuple(parents), tuple(last))
            seq.check()
            out.append(seq)
        self.rows.clear()
        return out
