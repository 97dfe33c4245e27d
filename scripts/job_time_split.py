"""Where a refilled batch's time goes: per method, the run's wall time split into prefilling waiting
prompts, admitting them into the batch's cache, and decoding steps (drafting and acceptance inside),
one process, rounds interleaved.

    .venv/bin/python scripts/job_time_split.py --batch-size 24 --methods ar,logitspec

The engine's and session's methods are wrapped with timers here (a profiling script: the library
itself is unchanged).
"""
import argparse
import collections
import time

from logitspec import Engine, SpecConfig
from logitspec import engine as engine_module
from logitspec import session as session_module
from logitspec.bench.questions import first_turns, warmup_question
from logitspec.bench.throughput import batch_prompts
from logitspec.models import load_model

SPENT: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def timed(cls, name: str) -> None:
    """Wrap ``cls.name`` so that its calls add their seconds to SPENT[name]."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
            CALLS[name] += 1
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--methods", default="ar,logitspec")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    for cls, name in ((session_module.Session, "_prefill_waiting"), (session_module.Session, "_admit_ready"),
                      (engine_module.Engine, "decode_step"), (engine_module.Engine, "_draft"),
                      (engine_module.Engine, "_accept")):
        timed(cls, name)
    B = args.batch_size
    model, tok = load_model("default", dtype=args.dtype)
    prompts = batch_prompts(first_turns(None, 1, max_chars=1500), B * args.prompts_per_slot)
    engines = {m: Engine(model, tok, SpecConfig(method=m, max_batch_size=B)) for m in args.methods.split(",")}
    warm = warmup_question(tok, model.config.get_text_config(decoder=True).vocab_size).turns[0]
    for e in engines.values():
        e.generate([warm], max_new_tokens=8)
        e.run(prompts[:B], max_new_tokens=32)
    for _ in range(args.rounds):
        for m, e in engines.items():
            SPENT.clear()
            CALLS.clear()
            t0 = time.perf_counter()
            run = e.run(prompts, max_new_tokens=64)
            wall = time.perf_counter() - t0
            split = {k: round(v, 2) for k, v in SPENT.items()}
            print(f"{m}: {run.stats['tokens_per_s']:.1f} tokens/s, wall {wall:.2f} s, {run.stats['batch_steps']} steps, "
                  f"prefill forwards {run.stats['prefill_chunks']}; seconds in {split}", flush=True)


if __name__ == "__main__":
    main()
