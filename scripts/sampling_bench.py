"""Sampling against greedy, side by side in one process: tokens/s and cost per token.

The first question of each of the first ``--categories`` Spec-Bench categories (first turn; the chat
template where the tokenizer has one), batch 1, through ``ar`` greedy, ``ar`` sampled and
``logitspec`` greedy and sampled; each sampled method with the screened sampler (the default on CPU)
and with full float32 rows (``Engine(..., screened_sampling=False)``). After a warm-up, the
configurations run interleaved per prompt, the order rotated per prompt; prints a markdown table.

    PYTHONPATH=. .venv/bin/python scripts/sampling_bench.py --temperature 0.8 --top-p 0.95 --seed 7
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from logitspec import Engine, SpecConfig, load_model
from logitspec.bench.questions import DEFAULT_QUESTIONS, PromptBuilder, load_questions


def first_of_categories(path, n: int) -> list:
    """The first question of each of the first ``n`` categories, in file order."""
    seen, out = set(), []
    for q in load_questions(path):
        if q.category not in seen and len(seen) < n:
            seen.add(q.category)
            out.append(q)
    return out


def configurations(model, tok, sampled: dict) -> dict:
    """name -> (engine, generate keywords)."""
    def engine(method, screened=True):
        return Engine(model, tok, SpecConfig(method=method), screened_sampling=screened)

    return {
        "ar greedy": (engine("ar"), {}),
        "ar sampled, screened": (engine("ar"), sampled),
        "ar sampled, full float32": (engine("ar", False), sampled),
        "logitspec greedy": (engine("logitspec"), {}),
        "logitspec sampled, screened": (engine("logitspec"), sampled),
        "logitspec sampled, full float32": (engine("logitspec", False), sampled),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--questions", default=str(DEFAULT_QUESTIONS))
    ap.add_argument("--categories", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    sampled = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    runs = configurations(model, tok, sampled)
    build = PromptBuilder(tok, next(iter(runs.values()))[0].encode)
    prompts = [build(q, 0, []) for q in first_of_categories(args.questions, args.categories)]
    for engine, kw in runs.values():  # warm-up (and the auto budget's calibration)
        engine.generate(prompts[:1], max_new_tokens=8, **kw)
    names = list(runs)
    wall, tokens, steps = ({k: 0 for k in names} for _ in range(3))
    for i, p in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine, kw = runs[name]
            t0 = time.perf_counter()
            res = engine.generate([p], max_new_tokens=args.max_new_tokens, **kw)[0]
            wall[name] += time.perf_counter() - t0
            tokens[name] += len(res.token_ids)
            steps[name] += res.stats["steps"]
    base = {m: wall[f"{m} greedy"] / tokens[f"{m} greedy"] for m in ("ar", "logitspec")}
    ar_of = {n: n.replace("logitspec", "ar") for n in names}
    print("| run | tokens | tokens/s | cost per token vs its method's greedy | vs `ar` at the same setting | MAT |")
    print("|---|---|---|---|---|---|")
    for name in names:
        per = wall[name] / tokens[name]
        vs_ar = (wall[ar_of[name]] / tokens[ar_of[name]]) / per
        print(f"| {name} | {tokens[name]} | {1 / per:.2f} | {per / base[name.split()[0]]:.2f}x | "
              f"{vs_ar:.2f}x | {tokens[name] / steps[name]:.2f} |")
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens, T {args.temperature}, top-p {args.top_p}, "
          f"top-k {args.top_k}, seed {args.seed}, chat template {build.chat}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")


if __name__ == "__main__":
    main()
