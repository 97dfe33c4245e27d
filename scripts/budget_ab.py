"""The auto budget as it is (curves on the model's own continuations, corrected by the steps it
times: logitspec.feedback) against as it was before 2026-12-02 (batch curves on arbitrary token
chains, no corrections), and `ar`, in one process, rounds interleaved.

    .venv/bin/python scripts/budget_ab.py --batch-sizes 6,24 --rounds 3 --prompts-per-slot 4

``--prompts-per-slot N``: batch size b runs b x N prompts (1: one static batch; more: rows refilled
as they finish, as in a job). Prints tokens/s per round, the median's ratio to `ar`, MAT, whether
the outputs equal `ar`'s, and the corrections the new engines learned.
"""
import argparse
import statistics
import sys

from logitspec import Engine, SpecConfig, calibrate
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.feedback import Realised
from logitspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="6,24")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts-per-slot", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    model, tok = load_model("default")
    engines = {}
    for b in (int(x) for x in args.batch_sizes.split(",")):
        config = SpecConfig(method="logitspec", max_batch_size=b)
        engines[("ar", b)] = Engine(model, tok, SpecConfig(method="ar", max_batch_size=b))
        engines[("now", b)] = now = Engine(model, tok, config)
        grid = calibrate.grid_for(now.target.device, quick=True)
        before = calibrate.measure(now.target, tokens=grid.tokens, reps=2, batch_rows=calibrate.rows_for(grid, b),
                                   batch_tokens=grid.per_row, batch_chains="arbitrary")
        engines[("before", b)] = old = Engine(model, tok, config, cost_curve=before)
        old.realised = Realised(min_rows=sys.maxsize)  # no corrections at any batch size
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
    prompts = first_turns(None, 1, max_chars=1500)
    runs, outputs = {k: [] for k in engines}, {}
    for r in range(args.rounds):
        keys = list(engines)
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            run = engines[k].run(batch_prompts(prompts, k[1] * args.prompts_per_slot), max_new_tokens=args.max_new_tokens)
            outputs[k] = [x.token_ids for x in run.results]
            runs[k].append((run.stats["tokens_per_s"], statistics.mean(x.stats["mean_accepted"] for x in run.results)))
    for (name, b), v in runs.items():
        med, base = statistics.median(x[0] for x in v), statistics.median(x[0] for x in runs[("ar", b)])
        print(f"{name:>6} @ {b:>2}: tokens/s {[round(x[0], 1) for x in v]}, median {med:.1f} ({med / base:.3f}x ar), "
              f"MAT {[round(x[1], 2) for x in v]}, output == ar: {outputs[(name, b)] == outputs[('ar', b)]}")
    for (name, b), e in engines.items():
        if name == "now":
            print(f"corrections learned @ {b}:", {k: round(v, 2) for k, v in e.realised.as_dict().items()})


if __name__ == "__main__":
    main()
