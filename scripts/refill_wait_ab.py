"""Slots refilled from waiting prompts: tokens/s with free slots refilled at once
(``SpecConfig(refill_wait=0)``) against waiting for company (the default), one process, rounds
interleaved.

    .venv/bin/python scripts/refill_wait_ab.py --batch-size 24 --methods ar,logitspec

Speculative rows finish one by one, so refilling each free slot at once costs a prefill forward per
prompt (docs/performance.md, "2026-12-03 (morning)").
"""
import argparse

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--methods", default="ar,logitspec")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model, tok = load_model("default")
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), args.batch_size * args.prompts_per_slot)
    engines = {}
    for m in args.methods.split(","):
        engines[(m, "at once")] = Engine(model, tok, SpecConfig(method=m, max_batch_size=args.batch_size, refill_wait=0))
        engines[(m, "waiting")] = Engine(model, tok, SpecConfig(method=m, max_batch_size=args.batch_size))
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    rates = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, e in engines.items():
            run = e.run(prompts, max_new_tokens=64)
            rates[k].append(round(run.stats["tokens_per_s"], 1))
            print(k, {s: round(run.stats[s], 2) for s in ("tokens_per_s", "mean_active", "prefill_chunks", "batch_steps")},
                  flush=True)
    for k, v in rates.items():
        print(k, v)


if __name__ == "__main__":
    main()
