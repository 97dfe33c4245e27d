"""Cost of the pipeline itself: the job with one actor vs the bare engine on the same rows.

    python -m pipeline.bench --input data/sample_prompts.jsonl --limit 12 --max-new-tokens 32 --repeats 2

Side by side in one session, alternating (bare, job, bare, job, ...), same rows, same engine settings,
same torch thread count, one compute process at a time (the driver idles while its actor works), a
fresh engine for every measured run (as the actor has):

* ``bare_all``: ``Engine.generate`` over all rows in one call (the engine's best case);
* ``bare_batches``: the same engine fed the job's batches (``--batch-rows``) one call after another;
* ``job``: ``run_job`` with one actor; rows/s counts only the generation phase (first batch sent to
  last result), start-up (Ray, actor, model load) is reported apart.

Prints one JSON record (and writes it with ``--out``). Ratios, not absolute times: this machine is shared.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

from .config import GenerationSpec, JobConfig
from .inputs import load_input, row_prompt

log = logging.getLogger("pipeline.bench")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default="data/sample_prompts.jsonl")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--model", default="default")
    p.add_argument("--method", default="logitspec")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--batch-rows", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import ray
    import torch

    from logitspec import Engine
    from logitspec.models import load_model

    from .job import run_job
    from .worker import row_seed

    gen = GenerationSpec(model=args.model, method=args.method, max_new_tokens=args.max_new_tokens,
                         max_batch_size=args.max_batch_size)
    base = dict(input=args.input, gen=gen, limit=args.limit, threads_per_actor=args.threads, actors=1,
                batch_rows=args.batch_rows, log_interval=60.0)
    cfg0 = JobConfig(output="unused", **base)
    data = load_input(cfg0)
    ids = list(data.ids)
    prompts = [row_prompt(data.prompts[i] if data.prompts else None, None, False) for i in range(len(ids))]
    size = cfg0.rows_per_batch

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)

    def fresh_engine():
        """A new engine per measured run, warmed up as the actor's is: no state carried between runs."""
        e = Engine(model, tok, gen.spec_config())
        e.generate([e.encode("Hello, world.")], max_new_tokens=2)
        return e

    engine = fresh_engine()
    encoded = [engine.encode(x) for x in prompts]
    seeds = [row_seed(gen.seed, i) for i in ids]
    kw = dict(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)

    import os

    os.environ.setdefault("RAY_worker_niceness", "0")  # as the job does for a local Ray (bare runs at nice 0 too)
    ray.init(num_cpus=args.threads, include_dashboard=False, logging_level="WARNING")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            engine = fresh_engine()
            t = time.perf_counter()
            res = engine.generate(encoded, seed=seeds, **kw)
            bare_all = time.perf_counter() - t
            bare_text = {i: r.text for i, r in zip(ids, res)}
            engine = fresh_engine()
            t = time.perf_counter()
            res_b = []
            for s in range(0, len(encoded), size):
                res_b += engine.generate(encoded[s:s + size], seed=seeds[s:s + size], **kw)
            bare_batches = time.perf_counter() - t

            def mat(rs):
                return sum(len(r.token_ids) for r in rs) / sum(r.stats["steps"] for r in rs)
            summary = run_job(JobConfig(output=f"{tmp}/job{rep}", **base))
            from .output import read_generations

            job_text = {r["id"]: r["generation"] for r in read_generations(f"{tmp}/job{rep}").to_pylist()}
            n = len(ids)
            rec = {
                "rows": n,
                "tokens": sum(len(r.token_ids) for r in res),
                "bare_all_rows_per_s": n / bare_all,
                "bare_batches_rows_per_s": n / bare_batches,
                "job_rows_per_s": summary["rows_per_s"],
                "job_over_bare_all": summary["rows_per_s"] / (n / bare_all),
                "job_over_bare_batches": summary["rows_per_s"] / (n / bare_batches),
                "job_startup_s": summary["timing"]["startup_s"],
                "job_ray_init_s": summary["timing"]["ray_init_s"],
                "job_replica_ready_s": summary["timing"]["replicas_first_ready_s"],
                "job_model_load_s": summary["replicas"]["startup"][0]["model_load_s"],
                "job_generation_s": summary["timing"]["generation_s"],
                "bare_all_mat": mat(res),
                "bare_batches_mat": mat(res_b),
                "job_mat": summary["mat"]["now"],
                "same_text_as_bare": sum(job_text[i] == bare_text[i] for i in ids) / n,
            }
            log.info("repeat %d: %s", rep, json.dumps(rec))
            runs.append(rec)
    ray.shutdown()
    record = {
        "bench": "pipeline_overhead", "model": args.model, "method": args.method, "input": args.input,
        "limit": args.limit, "max_new_tokens": args.max_new_tokens, "max_batch_size": args.max_batch_size,
        "batch_rows": size, "threads": args.threads, "repeats": runs,
        "median_job_over_bare_all": statistics.median(r["job_over_bare_all"] for r in runs),
        "median_job_over_bare_batches": statistics.median(r["job_over_bare_batches"] for r in runs),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
