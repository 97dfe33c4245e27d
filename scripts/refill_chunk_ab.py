"""Slots refilled from waiting prompts: tokens/s with short-prompt groups of ``prefill_chunk`` against
``fill_chunk`` tokens per step while rows decode, one process, rounds interleaved.

    .venv/bin/python scripts/refill_chunk_ab.py --batch-size 24 --method ar

Engine(prefill_chunk=P, fill_chunk=P) caps a step's prefill at P tokens (the behaviour before
2026-12-02 for P = 512); the default Engine groups short prompts up to fill_chunk (2,048).
"""
import argparse

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="the capped variant's tokens per step")
    args = ap.parse_args()
    model, tok = load_model("default")
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), args.batch_size * args.prompts_per_slot)
    config = SpecConfig(method=args.method, max_batch_size=args.batch_size)
    engines = {f"capped at {args.chunk}": Engine(model, tok, config, prefill_chunk=args.chunk, fill_chunk=args.chunk),
               "grouped up to fill_chunk": Engine(model, tok, config, prefill_chunk=args.chunk)}
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    rates = {k: [] for k in engines}
    for _ in range(args.rounds):
        for k, e in engines.items():
            run = e.run(prompts, max_new_tokens=64)
            rates[k].append(round(run.stats["tokens_per_s"], 1))
            print(k, {s: run.stats[s] for s in ("tokens_per_s", "mean_active", "prefill_chunks", "max_step_gap_s")})
    print({k: v for k, v in rates.items()})


if __name__ == "__main__":
    main()
