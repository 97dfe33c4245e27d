"""Drafting methods at equal fixed budgets, by replayed greedy acceptance.

Greedy decoding's output does not depend on the drafts, so one greedy trace of a prompt
(:func:`~logitspec.bench.analyses.greedy_traces`: the output and, per position, the top tokens of the
logits that chose it) says exactly what any drafter would have had accepted there: at each step the
drafter gets the context and LogitSpec's next-next guesses (those logits' top tokens without the
chosen one), drafts a tree of at most N nodes, and the tree's path that spells the next output
tokens is accepted; decoding jumps past it and its bonus token. This is the engine's drafting at
``budget="fixed"`` (one row: the capacity itself), replayed: MAT, tree size, retrieval success and
where the accepted tokens came from are exact for greedy decoding; speed is not (it needs the clock).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from logitspec.spec_decode.interface import KINDS

from ..config import SpecConfig

# the budgeted drafters (lookahead's tree has a fixed shape), and LogitSpec with its guesses reordered
METHODS = ("pld", "rest", "logitspec", "logitspec@guess_order=context")


def source_of(kind: int) -> str:
    """Where a node of ``kind`` came from: ``context`` (a retrieved continuation of the root) or
    ``guess`` (a branch that starts with a next-next guess)."""
    return "guess" if KINDS[kind].startswith("guess") else "context"


@dataclass
class Replayed:
    """One method at one budget over some traces: totals."""

    tokens: int = 0  # tokens emitted (the prefill's first one included)
    forwards: int = 0  # target forwards (the prefill included)
    nodes: int = 0  # draft nodes verified
    retrieved: int = 0  # decode steps whose tree held a retrieved draft
    accepted: dict = field(default_factory=lambda: {"context": 0, "guess": 0})  # drafted tokens by source

    def add(self, other: "Replayed") -> None:
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.nodes += other.nodes
        self.retrieved += other.retrieved
        for k, v in other.accepted.items():
            self.accepted[k] = self.accepted.get(k, 0) + v

    def as_dict(self) -> dict:
        decode = self.forwards - 1 if self.forwards else 0
        drafted = sum(self.accepted.values())
        return {"mat": round(self.tokens / self.forwards, 3) if self.forwards else None,
                "tree_nodes": round(self.nodes / decode, 2) if decode else None,
                "retrieval_success": round(self.retrieved / decode, 3) if decode else None,
                "accepted_drafted": drafted,
                "guess_share": round(self.accepted["guess"] / drafted, 4) if drafted else None}


def guesses_of(trace, k: int) -> list[list[int]]:
    """Per step of a greedy trace (:class:`~logitspec.bench.analyses.Trace`), the top-k tokens of the
    last logits without the chosen token (LogitSpec's guesses)."""
    return [[int(t) for t in row if t != tok][:k] for row, tok in zip(trace.top, trace.output)]


def replay_greedy(drafter, prompt: Sequence[int], output: Sequence[int], guesses: Sequence[Sequence[int]],
                  budget: int, max_ngram: int, min_ngram: int) -> Replayed:
    """Greedy decoding of ``output`` (its first token from the prefill) with ``drafter``'s trees of
    at most ``budget`` nodes; ``guesses[t]``: the next-next guesses when ``output[t]`` is the root."""
    from logitspec.spec_decode.ngram_index import SequenceIndex

    r = Replayed(tokens=len(output), forwards=1 if len(output) else 0)
    idx = SequenceIndex(list(prompt) + list(output[:1]), max_ngram, min_ngram)
    t = 0
    while t < len(output) - 1:
        room = len(output) - 1 - t  # tokens still to emit after the root; the bonus takes one
        tree = drafter.draft([idx], idx.tokens, list(guesses[t]), min(budget, room - 1))
        node, path = 0, []
        for want in output[t + 1:]:
            child = tree.child(node, int(want))
            if child is None:
                break
            node = child
            path.append(child)
        for n in path:
            r.accepted[source_of(int(tree.kinds[n]))] += 1
        r.forwards += 1
        r.nodes += len(tree) - 1
        r.retrieved += bool(tree.retrieved)
        step = len(path) + 1
        idx.extend([int(x) for x in output[t + 1:t + 1 + step]])
        t += step
    return r


def budget_report(traces, capacities: Sequence[int], methods: Sequence[str] = METHODS,
                  config: SpecConfig | None = None) -> dict:
    """Per method, per capacity N, per task and ``all``: :meth:`Replayed.as_dict` over ``traces``
    (:class:`~logitspec.bench.analyses.Trace`). ``methods``: names, or variants as the bench writes
    them (``logitspec@guess_order=context``). ``config``: the methods' other settings (default: the
    engine's defaults with ``budget="fixed"``)."""
    from logitspec.spec_decode.drafters import make_drafter

    from .methods import parse_methods
    from .questions import task_order

    base = (config or SpecConfig()).with_(budget="fixed")
    tasks = task_order(tr.task for tr in traces)
    out: dict = {}
    for spec in [s for s in parse_methods(list(methods)) if s.base != "ar"]:
        method = spec.name
        for n in capacities:
            cfg = base.with_(method=spec.base, capacity=n, pld_max_tokens=n, rest_num_draft=n,
                             **spec.overrides)
            drafter = make_drafter(cfg)
            per_task = {t: Replayed() for t in [*tasks, "all"]}
            for tr in traces:
                r = replay_greedy(drafter, tr.prompt, tr.output, guesses_of(tr, cfg.top_k), n, cfg.max_ngram,
                                  cfg.min_ngram)
                per_task[tr.task].add(r)
                per_task["all"].add(r)
            out.setdefault(method, {})[str(n)] = {t: v.as_dict() for t, v in per_task.items()}
    return out


def not_below(report: dict, better: str, worse: str) -> dict[str, list[str]]:
    """Per capacity, the tasks where ``better``'s MAT is below ``worse``'s (empty lists: never)."""
    out = {}
    for n, tasks in report[better].items():
        out[n] = [t for t, v in tasks.items() if (v["mat"] or 0) < (report[worse][n][t]["mat"] or 0) - 1e-9]
    return out


def mat_table(report: dict) -> str:
    """A markdown table: one row per (method, N), MAT per task and overall, tree nodes, retrieval
    success and the guesses' share of the accepted drafted tokens (all tasks)."""
    first = next(iter(report.values()))
    tasks = list(next(iter(first.values())))
    head = ("| method | N | " + " | ".join(tasks) + " | nodes/step | retrieval | guess share |\n"
            "|---|---|" + "---|" * (len(tasks) + 3))
    lines = [head]
    for method, by_n in report.items():
        for n, row in by_n.items():
            a = row["all"]
            share = "-" if a["guess_share"] is None else f"{100 * a['guess_share']:.1f}%"
            lines.append(f"| `{method}` | {n} | " + " | ".join(f"{row[t]['mat']:.2f}" for t in tasks)
                         + f" | {a['tree_nodes']} | {100 * a['retrieval_success']:.0f}% | {share} |")
    return "\n".join(lines)
