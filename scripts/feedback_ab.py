"""`logitspec` with the budget's learned corrections (logitspec.feedback) and without (the same
curve), and `ar`, in one process, rounds interleaved, on the throughput prompts at one batch size.

    .venv/bin/python scripts/feedback_ab.py --batch-size 6 --rounds 4

Prints per engine the rounds' (tokens/s, MAT), the median, and the corrections learned.
"""
import argparse
import statistics
import sys

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.feedback import Realised
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    model, tok = load_model("default")
    b = args.batch_size
    engines = {"ar": Engine(model, tok, SpecConfig(method="ar", max_batch_size=b)),
               "corrected": Engine(model, tok, SpecConfig(method="logitspec", max_batch_size=b)),
               "uncorrected": Engine(model, tok, SpecConfig(method="logitspec", max_batch_size=b))}
    engines["uncorrected"].realised = Realised(min_rows=sys.maxsize)  # no corrections at any batch size
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), b)
    results = {k: [] for k in engines}
    for r in range(args.rounds):
        keys = list(engines)
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            run = engines[k].run(prompts, max_new_tokens=64)
            results[k].append((round(run.stats["tokens_per_s"], 1),
                               round(statistics.mean(x.stats["mean_accepted"] for x in run.results), 2)))
    for k, v in results.items():
        print(f"{k:>11}: (tokens/s, MAT) {v}, median {statistics.median(x[0] for x in v):.1f}")
    print("corrections learned:", engines["corrected"].realised.as_dict())


if __name__ == "__main__":
    main()
