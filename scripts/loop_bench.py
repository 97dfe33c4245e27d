"""Measure the engine loop on a real model: the decoding stall while a long prompt is admitted
(interleaved chunks against one whole-prompt chunk), n samples from one prefill against n copies of
the prompt, and a prefix cache shared by two engines. Greedy; prints JSON lines.

    python scripts/loop_bench.py --model default --long 2000 --new 32
"""
from __future__ import annotations

import argparse
import json
import time

from logitspec import Engine, SpecConfig
from logitspec.models import load_model
from logitspec.prefix_cache import PrefixCache

TEXT = ("The library keeps a catalogue of every book, and each entry records the author, the year, "
        "the shelf and the number of times it was lent. ")


def _prompt(tok, n_tokens: int, salt: str) -> list[int]:
    ids = tok(salt + " " + TEXT * (n_tokens // 20 + 1)).input_ids
    return ids[:n_tokens]


def stall(model, tok, long_ids, short_ids, new, chunk):
    """A short row decodes; after 4 of its steps the long prompt is submitted."""
    eng = Engine(model, tok, SpecConfig(method="ar", max_batch_size=2), prefill_chunk=chunk)
    eng.generate([short_ids[:8]], max_new_tokens=2)  # warm-up
    session = eng.open(max_new_tokens=new)
    session.submit(short_ids)
    done = []
    for _ in range(4):
        done += session.step()
    session.submit(long_ids)
    t0 = time.perf_counter()
    done += session.drain()
    short = next(r for r in done if r.request_id == 0)
    return {"case": "stall", "prefill_chunk": chunk, "short_row_max_step_gap_s": round(short.stats["max_step_gap_s"], 3),
            "drain_s": round(time.perf_counter() - t0, 2)}


def samples(model, tok, ids, new, n):
    out = []
    for label, prompts, k in (("n_samples", [ids], n), ("n_copies", [ids] * n, 1)):
        eng = Engine(model, tok, SpecConfig(method="ar", max_batch_size=n))
        eng.generate([ids[:8]], max_new_tokens=2)
        run = eng.run(prompts, max_new_tokens=new, n=k)
        out.append({"case": label, "n": n, "wall_s": round(run.stats["wall_s"], 2), "prefills": run.stats["prefills"],
                    "prefill_s": round(sum(r.stats["prefill_s"] for r in run.results), 2)})
    return out


def shared_cache(model, tok, prompts, new):
    out = []
    for label, cache in (("no_cache", None), ("shared_cache", PrefixCache(max_bytes=4 << 30, block=512))):
        prefill = 0.0
        for method in ("ar", "logitspec"):
            run = Engine(model, tok, SpecConfig(method=method, max_batch_size=2), prefix_cache=cache).run(
                prompts, max_new_tokens=new)
            prefill += sum(r.stats["prefill_s"] for r in run.results)
        out.append({"case": label, "methods": 2, "prefill_s_total": round(prefill, 2),
                    "hit_rate": cache.stats["hit_rate"] if cache else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="model spec (as `logitspec bench --model`)")
    ap.add_argument("--long", type=int, default=2000, help="tokens of the long prompt")
    ap.add_argument("--new", type=int, default=32, help="new tokens per row")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt for the n case")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    long_ids, short_ids = _prompt(tok, args.long, "A"), _prompt(tok, 60, "B")
    for chunk in (256, args.long + 1):
        print(json.dumps(stall(model, tok, long_ids, short_ids, args.new, chunk)), flush=True)
    for rec in samples(model, tok, _prompt(tok, args.long // 2, "C"), args.new, args.samples):
        print(json.dumps(rec), flush=True)
    for rec in shared_cache(model, tok, [_prompt(tok, args.long // 2, s) for s in "DE"], args.new):
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
