"""Cost of the pipeline itself: the job with one actor vs the bare engine on the same rows.

    python -m pipeline.job.bench --input data/sample_prompts.jsonl --limit 12 --max-new-tokens 32 --repeats 2
    python -m pipeline.job.bench --input data/synthetic/prompts.jsonl --messages-column messages \
        --temperature 0.8 --top-p 0.95 --num-samples 4 --max-new-tokens 64 --max-batch-size 8

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
import os
import statistics
import tempfile
import time

from logitspec.engine.request import Request, add_request_flags, request_from_args

from ..io.inputs import open_input, read_columns, row_prompt
from ..spec import GenerationSpec, engine_config
from .config import JobConfig
from .pending import scan_ids

log = logging.getLogger("pipeline.job.bench")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", default="data/sample_prompts.jsonl")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--model", default="default")
    p.add_argument("--method", default="logitspec")
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--batch-rows", type=int, default=None)
    p.add_argument("--messages-column", default=None, help="chat messages column (as in jobs/generate.py)")
    p.add_argument("--no-stream", action="store_true",
                   help="the job's per-task replicas (jobs/generate.py --no-stream)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    add_request_flags(p, max_new_tokens=32)  # as the job's (samples per row share one prefill)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    import ray
    import torch

    from logitspec.models import load_model

    request = request_from_args(args)
    engine = engine_config(method=args.method, max_batch_size=args.max_batch_size)
    gen = GenerationSpec(model=args.model, engine=engine, request=request)
    base = {"input": args.input, "gen": gen, "limit": args.limit, "threads_per_actor": args.threads,
            "actors": 1,
            "batch_rows": args.batch_rows, "log_interval": 60.0, "messages_column": args.messages_column,
            "stream": not args.no_stream}
    cfg0 = JobConfig(output="unused", **base)
    # the job's own reader, so that the bare engine gets exactly the rows (and prompts) the job gets
    ids = scan_ids(open_input(cfg0)).ids.to_pylist()
    column = cfg0.messages_column or cfg0.prompt_column
    prompts = [row_prompt(p, None, False) for p in read_columns(cfg0, [column])[column]]

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    bare = BareRuns(model, tok, gen, ids, prompts, cfg0.rows_per_batch)

    # as the job does for a local Ray (bare runs at nice 0 too)
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.threads, include_dashboard=False, logging_level="WARNING")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            rec = measure_repeat(bare, base, f"{tmp}/job{rep}")
            log.info("repeat %d: %s", rep, json.dumps(rec))
            runs.append(rec)
    ray.shutdown()
    record = {
        "bench": "pipeline_overhead", "model": args.model, "method": args.method, "input": args.input,
        "limit": args.limit, "max_new_tokens": args.max_new_tokens, "max_batch_size": args.max_batch_size,
        "request": request.to_dict(), "num_samples": request.n,
        "batch_rows": cfg0.rows_per_batch, "threads": args.threads, "repeats": runs,
        "median_job_over_bare_all": statistics.median(r["job_over_bare_all"] for r in runs),
        "median_job_over_bare_batches": statistics.median(r["job_over_bare_batches"] for r in runs),
        "median_job_tokens_over_bare_all": statistics.median(r["job_tokens_over_bare_all"] for r in runs),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=2)
    return 0


class BareRuns:
    """The bare engine on the job's rows: every measured run on a fresh engine, warmed up as the actor's
    is, so no state carries between runs."""

    def __init__(self, model, tokenizer, gen: GenerationSpec, ids: list, prompts: list, batch_rows: int):
        """``prompts``: text or chat messages (encoded as the job encodes them); each row's request is the
        job's, seeded as the job seeds it (its ``n`` samples share one prefill)."""
        from ..replica.worker import row_seed

        self.model, self.tokenizer, self.gen = model, tokenizer, gen
        self.ids = ids
        encoder = self.fresh_engine()
        self.encoded = [encoder.encode(x, apply_chat_template=gen.chat) for x in prompts]
        self.requests = [gen.request.with_(seed=row_seed(gen.request.seed, i)) for i in ids]
        self.batch_rows = batch_rows
        self.keys = [(i, s) for i in ids for s in range(gen.request.n)]  # the results' order

    def fresh_engine(self):
        from logitspec import Engine

        e = Engine(self.model, self.tokenizer, self.gen.engine)
        e.generate([e.encode("Hello, world.")], Request(max_new_tokens=2))
        return e

    def all_rows(self) -> tuple[float, list]:
        """Every row in one ``generate`` call: (seconds, results)."""
        engine = self.fresh_engine()
        t = time.perf_counter()
        res = engine.generate(self.encoded, self.requests)
        return time.perf_counter() - t, res

    def job_batches(self) -> tuple[float, list]:
        """The job's batches, one ``generate`` call after another: (seconds, results)."""
        engine = self.fresh_engine()
        size = self.batch_rows
        t = time.perf_counter()
        res = []
        for s in range(0, len(self.encoded), size):
            res += engine.generate(self.encoded[s:s + size], self.requests[s:s + size])
        return time.perf_counter() - t, res


def measure_repeat(bare: BareRuns, base: dict, job_output: str) -> dict:
    """One repeat: bare (all rows), bare (the job's batches), then the job with one actor."""
    from ..io.output import read_generations
    from .run import run_job

    bare_all, res = bare.all_rows()
    bare_text = {k: r.text for k, r in zip(bare.keys, res)}
    bare_batches, res_b = bare.job_batches()
    summary = run_job(JobConfig(output=job_output, **base))
    job_text = {(r["id"], r["sample"]): r["generation"] for r in read_generations(job_output).to_pylist()}
    n = len(bare.keys)  # output rows: input rows x samples
    tokens = sum(len(r.token_ids) for r in res)
    return {
        "rows": n,
        "tokens": tokens,
        "bare_all_rows_per_s": n / bare_all,
        "bare_batches_rows_per_s": n / bare_batches,
        "job_rows_per_s": summary["rows_per_s"],
        "job_over_bare_all": summary["rows_per_s"] / (n / bare_all),
        "job_over_bare_batches": summary["rows_per_s"] / (n / bare_batches),
        "bare_all_tokens_per_s": tokens / bare_all,
        "job_tokens_per_s": summary["tokens"]["per_s"],
        "job_tokens_over_bare_all": summary["tokens"]["per_s"] / (tokens / bare_all),
        "job_startup_s": summary["timing"]["startup_s"],
        "job_ray_init_s": summary["timing"]["ray_init_s"],
        "job_replica_ready_s": summary["timing"]["replicas_first_ready_s"],
        "job_model_load_s": summary["replicas"]["startup"][0]["model_load_s"],
        "job_generation_s": summary["timing"]["generation_s"],
        "bare_all_mat": _mat(res),
        "bare_batches_mat": _mat(res_b),
        "job_mat": summary["mat"]["now"],
        "same_text_as_bare": sum(job_text[k] == bare_text[k] for k in bare.keys) / n,
    }


def _mat(results) -> float:
    """Tokens per target forward over a run's results."""
    return sum(len(r.token_ids) for r in results) / sum(r.stats["steps"] for r in results)


if __name__ == "__main__":
    raise SystemExit(main())
