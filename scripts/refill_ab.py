"""Slots refilled from waiting prompts, two ways against each other, one process, rounds interleaved.

    .venv/bin/python scripts/refill_ab.py --compare chunk --batch-size 24 --methods ar
    .venv/bin/python scripts/refill_ab.py --compare wait --batch-size 24 --methods ar,logitspec

``--compare chunk``: short-prompt groups capped at ``prefill_chunk`` tokens a step
(``Engine(prefill_chunk=P, fill_chunk=P)``, the behaviour before 2026-12-02 for P = 512) against the
default grouping up to ``fill_chunk`` (2,048). ``--compare wait``: every free slot refilled at once
(``SpecConfig(refill_wait=0)``) against free slots waiting for company (the default ``refill_wait``).
"""
import argparse

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def variants(compare: str, chunk: int) -> dict[str, tuple[dict, dict]]:
    """Name -> (SpecConfig fields, Engine keyword arguments) of the two ways compared."""
    if compare == "chunk":
        return {f"capped at {chunk}": ({}, {"prefill_chunk": chunk, "fill_chunk": chunk}),
                "grouped up to fill_chunk": ({}, {"prefill_chunk": chunk})}
    return {"at once": ({"refill_wait": 0}, {}), "waiting": ({}, {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", choices=("chunk", "wait"), default="wait")
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--methods", default="ar,logitspec")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512, help="--compare chunk: the capped variant's tokens per step")
    args = ap.parse_args()
    model, tok = load_model("default")
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), args.batch_size * args.prompts_per_slot)
    engines = {(m, name): Engine(model, tok, SpecConfig(method=m, max_batch_size=args.batch_size, **fields), **kwargs)
               for m in args.methods.split(",") for name, (fields, kwargs) in variants(args.compare, args.chunk).items()}
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
