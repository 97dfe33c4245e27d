"""The LogitSpec paper's two analyses on our models, over greedy decoding traces of Spec-Bench prompts.

* ``topk``: the share of steps whose true next-next token is in the top-k of the last logits, for
  k = 1..100 (the paper: "top-60 holds > 50%" for Vicuna). At step t the last logits ``L_t`` chose
  ``x1 = y_t``; the next-next token is ``y_{t+1}``; its rank counts every entry of ``L_t`` above it
  (``x1`` included, so rank 1 means ``y_{t+1} == y_t``: LogitSpec's guesses leave ``x1`` out and
  start at rank 2).
* ``retrieval``: the share of steps where a drafter retrieved a non-empty draft from the sequence's
  own context (prompt + tokens so far), LogitSpec with and without next-next guidance (without:
  guesses off, the lookup for ``x1`` alone, as prompt lookup), with PLD and REST (context as the
  datastore) beside them. A step is every position of the trace (each a point where decoding could
  stand), not the steps one decoder took; the drafters are pure, so this is their answer there.

* ``budget``: every budgeted drafter at equal fixed budgets N (``--capacities``), by replayed greedy
  acceptance (:mod:`logitspec.bench.budget_replay`): MAT per task, tree size, retrieval success and
  the share of accepted drafted tokens that came from guess branches.

``python -m logitspec.bench.analyses topk|retrieval|budget|all --model default --per-task 1
--max-new-tokens 64 --out DIR`` prints a table and writes ``DIR/topk.json`` / ``DIR/retrieval.json`` /
``DIR/budget.json`` (``budget.md``: its table).
The counting functions (:func:`next_next_ranks`, :func:`topk_shares`, :func:`retrieval_flags`) are
pure and take hand-made traces.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .budget_replay import guesses_of

K_MAX = 100  # the paper's curve: k = 1..100
RETRIEVAL_VARIANTS = ("logitspec", "logitspec_no_guesses", "pld", "rest_context")


# ------------------------------------------------------------------------------------ pure counting
def next_next_ranks(logits, tokens: Sequence[int]) -> np.ndarray:
    """int64 [T - 1]: per step t, the 1-based rank of ``tokens[t + 1]`` in ``logits[t]``, where
    ``logits[t]`` ([T, V], array or tensor) are the scores that chose ``tokens[t]`` (rank: 1 + the
    entries strictly above it)."""
    import torch

    z = torch.as_tensor(logits)
    if len(tokens) < 2:
        return np.zeros(0, dtype=np.int64)
    nxt = torch.as_tensor(list(tokens[1:]), dtype=torch.long)
    z = z[: len(tokens) - 1]
    own = z.gather(1, nxt[:, None])  # [T - 1, 1]
    return ((z > own).sum(dim=1) + 1).numpy().astype(np.int64)


def topk_shares(ranks: Sequence[int], k_max: int = K_MAX) -> np.ndarray:
    """float64 [k_max]: entry k - 1 is the share of ``ranks`` <= k (NaN for no ranks)."""
    r = np.asarray(ranks, dtype=np.int64)
    if not len(r):
        return np.full(k_max, np.nan)
    hist = np.bincount(np.clip(r, 1, k_max + 1), minlength=k_max + 2)[1 : k_max + 1]
    return np.cumsum(hist) / len(r)


def first_k_over(shares: np.ndarray, level: float = 0.5) -> int | None:
    """The smallest k whose share exceeds ``level`` (None if none up to k_max)."""
    hit = np.flatnonzero(np.asarray(shares) > level)
    return int(hit[0]) + 1 if len(hit) else None


def retrieval_flags(prompt: Sequence[int], output: Sequence[int], guesses: Sequence[Sequence[int]],
                    config=None, variants: Sequence[str] = RETRIEVAL_VARIANTS) -> dict[str, list[bool]]:
    """Per variant, per step t (root ``output[t]``, context ``prompt + output[:t + 1]``), whether the
    drafter retrieved a non-empty draft from the context; ``guesses[t]``: the next-next guesses
    (``x1`` left out) the last logits gave at step t. ``config``: the LogitSpec settings (default:
    the paper's, :meth:`~logitspec.config.SpecConfig.paper`)."""
    from logitspec.spec_decode.drafters import make_drafter
    from logitspec.spec_decode.ngram_index import SequenceIndex

    from ..config import SpecConfig

    cfg = config or SpecConfig.paper()
    drafters = {
        "logitspec": (make_drafter(cfg.with_(method="logitspec")), True),
        "logitspec_no_guesses": (make_drafter(cfg.with_(method="logitspec")), False),
        "pld": (make_drafter(cfg.with_(method="pld")), False),
        "rest_context": (make_drafter(cfg.with_(method="rest")), False),
    }
    out: dict[str, list[bool]] = {v: [] for v in variants}
    idx = SequenceIndex(prompt, cfg.max_ngram, cfg.min_ngram)
    for t, tok in enumerate(output):
        idx.extend([tok])
        for v in variants:
            d, guided = drafters[v]
            tree = d.draft([idx], idx.tokens, list(guesses[t]) if guided else [], d.base_budget())
            out[v].append(bool(tree.retrieved))
    return out


# ------------------------------------------------------------------------------------------ traces
@dataclass
class Trace:
    """A greedy generation: ``ranks[t]``: rank of ``output[t + 1]`` in the logits that chose
    ``output[t]``; ``top[t]``: those logits' top tokens, best first."""

    task: str
    question_id: object
    prompt: list[int]
    output: list[int]
    ranks: np.ndarray  # int64 [T - 1]
    top: np.ndarray  # int64 [T, k]


def greedy_traces(model, tokenizer, questions, max_new_tokens: int, top: int = 65) -> list[Trace]:
    """The first turn of each question decoded greedily (``ar`` in our engine: plain greedy), then one
    forward over prompt + output for the logits of every generated position (only those kept)."""
    import torch

    from logitspec.engine.engine import Engine

    from ..config import SpecConfig
    from .questions import PromptBuilder

    eng = Engine(model, tokenizer, SpecConfig(method="ar"))
    build = PromptBuilder(tokenizer, eng.encode)
    prompts = [build(q, 0, []) for q in questions]
    outs = [r.token_ids for r in eng.generate(prompts, max_new_tokens=max_new_tokens)]
    traces = []
    for q, p, o in zip(questions, prompts, outs):
        if not o:
            continue
        with torch.inference_mode():
            x = torch.tensor([p + o[:-1]])
            logits = model(x, logits_to_keep=len(o)).logits[0].float()  # [T, V]: row t chose o[t]
        traces.append(Trace(q.task, q.question_id, list(p), list(o), next_next_ranks(logits, o),
                            torch.topk(logits, min(top, logits.shape[-1]), dim=-1).indices.numpy()))
    return traces


# ------------------------------------------------------------------------------------------ reports
def topk_report(traces: Sequence[Trace], k_max: int = K_MAX) -> dict:
    """Per task and overall: steps, shares for k = 1..k_max, and the smallest k above 50%."""
    from .questions import task_order

    groups = {t: [tr for tr in traces if tr.task == t] for t in task_order(tr.task for tr in traces)}
    groups["all"] = list(traces)
    out = {}
    for name, trs in groups.items():
        ranks = np.concatenate([tr.ranks for tr in trs]) if trs else np.zeros(0, dtype=np.int64)
        shares = topk_shares(ranks, k_max)
        out[name] = {"steps": int(len(ranks)), "shares": [round(float(s), 4) for s in shares],
                     "first_k_over_50": first_k_over(shares), "same_as_x1": float(np.mean(ranks == 1))
                     if len(ranks) else None}
    return out


def retrieval_report(traces: Sequence[Trace], config=None) -> dict:
    """Per task and overall: steps and the share of steps with a retrieved draft per variant."""
    from ..config import SpecConfig
    from .questions import task_order

    cfg = config or SpecConfig.paper()
    flags = [retrieval_flags(tr.prompt, tr.output, guesses_of(tr, cfg.top_k), cfg) for tr in traces]
    out = {}
    for name in task_order(tr.task for tr in traces) + ["all"]:
        sel = [f for f, tr in zip(flags, traces) if name == "all" or tr.task == name]
        steps = sum(len(f[RETRIEVAL_VARIANTS[0]]) for f in sel)
        out[name] = {"steps": steps, **{v: round(sum(sum(f[v]) for f in sel) / steps, 4) if steps else None
                                        for v in RETRIEVAL_VARIANTS}}
    return out


def _print_topk(rep: dict) -> None:
    ks = (1, 2, 5, 10, 20, 40, 60, 80, 100)
    print("task            steps  " + "  ".join(f"top{k:<3d}" for k in ks) + "  k>50%")
    for name, r in rep.items():
        cells = "  ".join(f"{r['shares'][k - 1]:6.3f}" for k in ks)
        print(f"{name:<15} {r['steps']:5d}  {cells}  {r['first_k_over_50']}")


def _print_retrieval(rep: dict) -> None:
    print("task            steps  " + "  ".join(f"{v:>20}" for v in RETRIEVAL_VARIANTS))
    for name, r in rep.items():
        print(f"{name:<15} {r['steps']:5d}  " + "  ".join(f"{r[v]:20.3f}" for v in RETRIEVAL_VARIANTS))


# ------------------------------------------------------------------------------------------ command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's options (for a ``logitspec`` subcommand too: then call :func:`run_from_args`)."""
    p.add_argument("analysis", choices=("topk", "retrieval", "budget", "all"),
                   help="topk: share of steps whose true next-next token is in the top-k of the last "
                        "logits (k = 1..100); retrieval: retrieval success with and without next-next "
                        "guidance; budget: the drafters at equal fixed budgets (--capacities), MAT by "
                        "replayed greedy acceptance; all: the three")
    p.add_argument("--model", default="default", help="a logitspec model spec (default: the embedded "
                                                      "Gemma 3 270M)")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: beside the "
                                                     "repository)")
    p.add_argument("--data", default="spec_bench",
                   help="comma-separated: spec_bench (--questions), longbench (--longbench-dir's rows)")
    p.add_argument("--longbench-dir", default=None, help="a LongBench-format directory (default: the "
                                                         "repository's data/longbench_local)")
    p.add_argument("--per-task", type=int, default=1, help="questions per task (first turns)")
    p.add_argument("--capacities", default="8,16,32,64", help="budget: the fixed budgets N, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens traced per question")
    p.add_argument("--out", required=True, help="output directory (topk.json / retrieval.json)")


def run_from_args(args) -> dict:
    from ..models import load_model
    from .questions import load_questions

    t0 = time.perf_counter()
    data = [d for d in args.data.split(",") if d]
    if not data or set(data) - {"spec_bench", "longbench"}:
        raise ValueError(f"--data: choose from spec_bench, longbench; got {args.data!r}")
    capacities = [int(c) for c in args.capacities.split(",") if c]
    if not capacities or min(capacities) < 1:
        raise ValueError(f"--capacities: positive integers, got {args.capacities!r}")
    qs = load_questions(args.questions, args.per_task) if "spec_bench" in data else []
    model, tok = load_model(args.model)
    if "longbench" in data:
        qs = qs + _longbench(args, model, tok)
    traces = greedy_traces(model, tok, qs, args.max_new_tokens)
    settings = {"model": args.model, "per_task": args.per_task, "max_new_tokens": args.max_new_tokens,
                "questions": len(qs), "traces": len(traces), "trace_s": round(time.perf_counter() - t0, 1),
                "command": f"logitspec analyses {args.analysis} --model {args.model} --per-task "
                           f"{args.per_task} --max-new-tokens {args.max_new_tokens} --out {args.out}"
                           + (f" --questions {args.questions}" if args.questions else "")
                           + (f" --data {args.data}" if args.data != "spec_bench" else "")
                           + (f" --capacities {args.capacities}" if args.analysis in ("budget", "all")
                              else "")}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    if args.analysis in ("topk", "all"):
        rep = topk_report(traces)
        (out / "topk.json").write_text(json.dumps({"settings": settings, "tasks": rep}, indent=1) + "\n")
        _print_topk(rep)
        result["topk"] = rep
    if args.analysis in ("retrieval", "all"):
        from ..config import SpecConfig

        cfg = SpecConfig.paper()
        rep = retrieval_report(traces, cfg)
        (out / "retrieval.json").write_text(json.dumps(
            {"settings": {**settings, "logitspec": {"top_k": cfg.top_k, "capacity": cfg.capacity,
                                                     "max_ngram": cfg.max_ngram, "min_ngram": cfg.min_ngram}},
             "tasks": rep}, indent=1) + "\n")
        _print_retrieval(rep)
        result["retrieval"] = rep
    if args.analysis in ("budget", "all"):
        from .budget_replay import budget_report, mat_table

        rep = budget_report(traces, capacities)
        (out / "budget.json").write_text(json.dumps({"settings": settings, "methods": rep}, indent=1) + "\n")
        table = mat_table(rep)
        (out / "budget.md").write_text(f"`{settings['command']}` (replayed greedy acceptance)\n\n{table}\n")
        print(table)
        result["budget"] = rep
    return result


def _longbench(args, model, tokenizer) -> list:
    """The first ``--per-task`` rows of each LongBench-format data set, as token-id questions."""
    from logitspec.engine.engine import Engine

    from ..config import SpecConfig
    from .longbench_set import LONGBENCH_DIR, longbench_questions

    eng = Engine(model, tokenizer, SpecConfig(method="ar"))
    return longbench_questions(args.longbench_dir or LONGBENCH_DIR, tokenizer, eng.encode, eng.max_context,
                               args.per_task, max_new_cap=args.max_new_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m logitspec.bench.analyses",
                                 description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    run_from_args(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
