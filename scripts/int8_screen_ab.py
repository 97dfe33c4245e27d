"""End to end with and without the int8 screen pass, rounds interleaved, on the same engine and prompts.

    .venv/bin/python scripts/int8_screen_ab.py [--batch-size 6] [--method logitspec] [--rounds 4]

Spec-Bench's first turns (one per task, repeated to fill the batch), greedy, 64 new tokens. One
engine; between runs only ``screen.int8.enabled`` changes (so the other passes' timing choices and
the cost curve are shared). Prints the race's choice per row count (with its timings, from the
``logitspec.int8_screen`` log), whether both outputs are identical, tokens/s per round (prefill
included), the mean tokens per step (MAT) and the per-round ratio.
"""
import argparse
import logging
import statistics
import time

import torch

from logitspec import Engine, SpecConfig
from logitspec.bench.questions import first_turns
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--method", default="logitspec")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("logitspec.int8_screen").setLevel(logging.DEBUG)
    with torch.inference_mode():
        model, tok = load_model("default")
        engine = Engine(model, tok, SpecConfig(method=args.method, max_batch_size=args.batch_size))
        prompts = [engine.encode(q) for q in first_turns(per_task=1)]
        prompts = (prompts * -(-args.batch_size // len(prompts)))[:max(args.batch_size, len(prompts))]
        screen = engine.target.head.screen
        if screen is None or not screen.int8.enabled:
            raise SystemExit("the int8 pass is not available here (no screen, no AVX-512 VNNI, or LOGITSPEC_INT8_SCREEN=off)")
        engine.run(prompts, max_new_tokens=16)  # warm-up: calibrates the int8 pass
        speed, outputs, mat = {True: [], False: []}, {}, {True: [], False: []}
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                screen.int8.enabled = on
                t0 = time.perf_counter()
                run = engine.run(prompts, max_new_tokens=args.max_new_tokens)
                speed[on].append(sum(len(x.token_ids) for x in run.results) / (time.perf_counter() - t0))
                outputs.setdefault(on, [x.token_ids for x in run.results])
                mat[on].append(sum(len(x.token_ids) for x in run.results) / sum(x.stats["steps"] for x in run.results))
    print(f"{args.method}, {args.batch_size} rows; int8 pass kept for row counts: "
          f"{sorted(k for k, v in screen.int8.chosen.items() if v)}, not for {sorted(k for k, v in screen.int8.chosen.items() if not v)}")
    print("identical outputs:", outputs[True] == outputs[False])
    for on in (True, False):
        print(f"{'int8 on ' if on else 'int8 off'} tokens/s {[round(v, 1) for v in speed[on]]}, "
              f"median {statistics.median(speed[on]):.1f}; MAT {[round(v, 2) for v in mat[on]]}")
    print("on / off per round:", [round(a / b, 3) for a, b in zip(speed[True], speed[False])])


if __name__ == "__main__":
    main()
