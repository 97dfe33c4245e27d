"""Batched throughput: tokens/s of methods at several batch sizes, side by side in one process.

``logitspec throughput --batch-sizes 1,4,8 --methods ar,logitspec`` runs the same prompts through
``Engine.generate`` for every (batch size, method), rounds interleaved so machine noise hits all
alike, after a warm-up, and prints a table of median tokens/s and the ratio to ``ar``.
"""
from __future__ import annotations

import json
import pathlib
import statistics
import time

from .config import SpecConfig


def spec_bench_prompts(path, per_task: int, max_chars: int = 1500) -> list[str]:
    """The first ``per_task`` first turns of each Spec-Bench task (MT-bench categories as one)."""
    rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    taken: dict[str, int] = {}
    out = []
    for r in rows:
        task = "mt_bench" if r["category"] in mt else r["category"]
        if taken.get(task, 0) < per_task:
            taken[task] = taken.get(task, 0) + 1
            out.append(r["turns"][0][:max_chars])
    return out


def run(model, tokenizer, prompts, methods, batch_sizes, max_new_tokens: int, rounds: int = 2,
        configs: dict[str, SpecConfig] | None = None) -> dict:
    from .engine import Engine

    configs = configs or {}
    engines = {(m, b): Engine(model, tokenizer, configs.get(m, SpecConfig(method=m)).with_(max_batch_size=b))
               for m in methods for b in batch_sizes}
    for e in engines.values():  # warm-up (and the auto budget's first calibration)
        e.generate(prompts[:1], max_new_tokens=8)
    tps = {k: [] for k in engines}
    outputs = {}
    for r in range(rounds):
        keys = list(engines)
        keys = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in keys:
            res = engines[k].generate(prompts, max_new_tokens=max_new_tokens)
            tps[k].append(engines[k].last_run_stats["tokens_per_s"])
            outputs[k] = [x.token_ids for x in res]
            mat = statistics.mean(x.stats["mean_accepted"] for x in res)
            engines[k].last_mat = mat
    table = {}
    for b in batch_sizes:
        base = statistics.median(tps[("ar", b)]) if ("ar", b) in tps else None
        for m in methods:
            t = statistics.median(tps[(m, b)])
            table[f"{m}@{b}"] = {
                "method": m, "batch_size": b, "tokens_per_s": t, "vs_ar": t / base if base else None,
                "mat": engines[(m, b)].last_mat,
                "same_as_ar": outputs[(m, b)] == outputs[("ar", b)] if ("ar", b) in outputs else None,
                "rounds": tps[(m, b)],
            }
    return table


def render(table: dict) -> str:
    lines = ["| batch | method | tokens/s | vs ar | MAT | output == ar |", "|---|---|---|---|---|---|"]
    for row in table.values():
        vs = f"{row['vs_ar']:.2f}x" if row["vs_ar"] else "-"
        lines.append(f"| {row['batch_size']} | {row['method']} | {row['tokens_per_s']:.2f} | {vs} | "
                     f"{row['mat']:.2f} | {row['same_as_ar']} |")
    return "\n".join(lines)


def add_throughput_command(sub) -> None:
    p = sub.add_parser("throughput", help="tokens/s of methods at several batch sizes, side by side")
    p.add_argument("--model", default="default")
    p.add_argument("--methods", default="ar,logitspec")
    p.add_argument("--batch-sizes", default="1,4,8")
    p.add_argument("--questions", default=None, help="Spec-Bench question.jsonl (default: ../shared/...)")
    p.add_argument("--per-task", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the table as JSON here")
    p.set_defaults(func=_main)


def _main(args) -> int:
    from .models import load_model

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        SpecConfig(method=m)  # fail fast on a typo
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    q = pathlib.Path(args.questions) if args.questions else \
        pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
    if not q.exists():
        raise ValueError(f"questions file not found: {q} (pass --questions)")
    prompts = spec_bench_prompts(q, args.per_task)
    model, tok = load_model(args.model)
    t0 = time.perf_counter()
    table = run(model, tok, prompts, methods, sizes, args.max_new_tokens, args.rounds)
    print(render(table))
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.rounds} rounds, "
          f"{time.perf_counter() - t0:.0f} s")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(table, indent=1))
    return 0
