"""Why speculation barely moves a static batch: per row, its MAT and its decoding steps, for ``ar``
and the speculative methods, on the throughput prompts (one static batch of B rows).

    .venv/bin/python scripts/static_batch_rows.py --batch-size 6

A static batch ends with its slowest row; a row whose drafts are rarely accepted (Spec-Bench's
writing prompt here) sets the number of steps whatever the others accept.
"""
import argparse
import time

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    B = args.batch_size
    model, tok = load_model("default")
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), B)
    configs = {"ar": SpecConfig(method="ar", max_batch_size=B),
               "pld": SpecConfig(method="pld", max_batch_size=B),
               "logitspec": SpecConfig(method="logitspec", max_batch_size=B),
               "logitspec fixed 2": SpecConfig(method="logitspec", budget="fixed", capacity=2, budget_decay=0,
                                               max_batch_size=B)}
    engines = {k: Engine(model, tok, c) for k, c in configs.items()}
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    for r in range(args.rounds):
        for k, e in engines.items():
            t0 = time.perf_counter()
            res = e.generate(prompts, max_new_tokens=64)
            wall = time.perf_counter() - t0
            if r == args.rounds - 1:
                print(f"{k}: {wall:.2f} s, forward {res[0].stats['forward_s']:.2f} s; per row MAT "
                      f"{[round(x.stats['mean_accepted'], 2) for x in res[:6]]}, steps {[x.stats['steps'] for x in res[:6]]}")


if __name__ == "__main__":
    main()
