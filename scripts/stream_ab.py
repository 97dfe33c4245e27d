"""Streaming vs per-task rows on one engine config, in one process, alternating (no Ray).

    python scripts/stream_ab.py --model default --max-batch-size 8 --task-rows 8 --repeats 2

Feeds the rows of data/sample_prompts.jsonl as tasks of ``--task-rows`` rows either to
:class:`pipeline.worker.RowGenerator` one task after another (the ``--no-stream`` replica), or to
:class:`pipeline.streaming.StreamingRows` with two tasks queued at a time (the streaming replica as the
scheduler feeds it); a fresh engine per measured run. Prints wall time, tokens/s, decoding forwards,
rows per forward, prefill forwards, and whether the generations are identical.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    import torch

    from logitspec import Engine
    from logitspec.models import load_model
    from pipeline.config import GenerationSpec
    from pipeline.replica_setup import warm_up
    from pipeline.streaming import StreamingRows
    from pipeline.worker import RowGenerator

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--task-rows", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()]
    tasks = [rows[i:i + args.task_rows] for i in range(0, len(rows), args.task_rows)]
    spec = GenerationSpec(model=args.model, max_batch_size=args.max_batch_size, max_new_tokens=args.max_new_tokens,
                          temperature=0.8, top_p=0.95, seed=1, stop=("\n\n",))
    model, tok = load_model(args.model)
    texts = {}
    for rep in range(args.repeats):
        for mode in ("tasks", "stream"):
            engine = Engine(model, tok, spec.spec_config())
            warm_up(engine, tok)
            gen = RowGenerator(engine, spec)
            t0 = time.perf_counter()
            if mode == "tasks":
                results = [gen(t) for t in tasks]
            else:
                stream, queued, results = StreamingRows(gen), [], []
                for t in tasks:  # two tasks in flight, as the scheduler keeps them
                    queued.append(stream.put(t))
                    if len(queued) == 2:
                        results.append(stream.wait(queued.pop(0)))
                results += [stream.wait(q) for q in queued]
            wall = time.perf_counter() - t0
            out = [r for rs, _ in results for r in rs]
            eng = [s["engine"] for _, s in results]
            steps = sum(e["batch_steps"] for e in eng)
            active = sum(e.get("active_sum", e["batch_steps"] * e["mean_active"]) for e in eng)
            tokens = sum(r["n_new_tokens"] or 0 for r in out)
            texts.setdefault(mode, {r["id"]: r["generation"] for r in out})
            print(f"repeat {rep} {mode:6s} wall {wall:6.1f} s  {tokens / wall:6.2f} tok/s  forwards {steps}  "
                  f"rows/forward {active / steps:.2f}  prefill forwards {sum(e['prefill_chunks'] for e in eng)}",
                  flush=True)
    print("identical generations:", texts["tasks"] == texts["stream"])


if __name__ == "__main__":
    main()
