"""TP=1 vs TP=N through the job, side by side: equal generations, step-time ratio, memory per rank.

    python scripts/tp_measure.py --model default --tp 2 --rows 4 --max-new-tokens 32 --out out/tp_measure
    python scripts/tp_measure.py --model /models/llama-8b --tp 2 --gpu ...      # one GPU per rank

Each run is ``jobs/generate.py``'s own path (``pipeline.job.cli`` arguments -> ``run_job``), in this
process so the replicas' start-up info (every rank's memory) can be kept. ``--max-batch-size 1`` makes
``wall_s / steps`` of a row its step time. Prints one JSON record (also ``<out>/result.json``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def _rows(n: int, src: pathlib.Path) -> list[dict]:
    rows = []
    for line in src.read_text().splitlines():
        d = json.loads(line)
        prompt = d.get("prompt") or (d.get("turns") or [None])[0]
        rows.append({"id": str(d.get("id", d.get("question_id"))), "prompt": prompt})
        if len(rows) == n:
            break
    return rows


def main() -> int:
    repo = pathlib.Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--method", default="ar")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    questions = repo.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
    ap.add_argument("--prompts", default=str(questions))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--gpu", action="store_true",
                    help="GPUs: the TP=1 replica takes one, each rank --gpus-per-rank")
    ap.add_argument("--gpus-per-rank", type=float, default=1.0,
                    help="< 1 lets ranks share a GPU (then gloo, not NCCL: a correctness check, "
                         "not a speed one)")
    ap.add_argument("--cpus", type=float, default=None, help="CPUs per rank; default: all / tp (TP=1: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per process; default floor(CPUs)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--runner", default="auto", help="the job's --runner (graph: captured TP steps on CUDA)")
    ap.add_argument("--out", default="out/tp_measure")
    a = ap.parse_args()

    import os

    import ray

    from pipeline.io.output import read_generations
    from pipeline.job.cli import build_parser, config_from_args
    from pipeline.job.run import run_job

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src = pathlib.Path(a.prompts)
    if not src.exists():
        src = repo / "data" / "sample_prompts.jsonl"
    rows = _rows(a.rows, src)
    inp = out / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ncpu = os.cpu_count() or 1
    ray.init(num_cpus=ncpu, include_dashboard=False, logging_level="WARNING")
    address = ray.get_runtime_context().gcs_address
    record: dict = {"model": a.model, "method": a.method, "runner": a.runner, "rows": len(rows),
                    "max_new_tokens": a.max_new_tokens, "prompts": str(src),
                    "device": "gpu" if a.gpu else "cpu", "dtype": a.dtype,
                    "gpus_per_rank": a.gpus_per_rank if a.gpu else 0, "runs": {}}
    gens = {}
    for tp in (1, a.tp):
        cpus = a.cpus or max(1.0, ncpu / tp) if not a.gpu else (a.cpus or 1.0)
        argv = ["--input", str(inp), "--output", str(out / f"tp{tp}"), "--overwrite", "--model", a.model,
                "--method", a.method, "--max-new-tokens", str(a.max_new_tokens), "--max-batch-size", "1",
                "--batch-rows", "1", "--tp", str(tp), "--cpus-per-actor", str(cpus),
                "--threads-per-actor", str(a.threads or max(1, int(cpus))), "--address", address,
                "--dtype", a.dtype, "--runner", a.runner, "-q"]
        if a.gpu:
            argv += ["--gpus-per-actor", str(1.0 if tp == 1 else a.gpus_per_rank)]
        ready = []
        t0 = time.perf_counter()
        summary = run_job(config_from_args(build_parser().parse_args(argv)),
                          on_event=lambda kind, **k: ready.append(k["info"]) if kind == "ready" else None)
        wall = time.perf_counter() - t0
        table = read_generations(out / f"tp{tp}").to_pylist()
        gens[tp] = {r["id"]: r for r in table}
        step = [r["wall_s"] / r["steps"] for r in table if r["steps"]]
        info = ready[0] if ready else {}
        ranks = info.get("ranks") or [info]
        record["runs"][f"tp{tp}"] = {
            "argv": argv, "job_wall_s": round(wall, 1), "complete": summary["complete"],
            "replica_ready_s": round(info.get("ready_s", float("nan")), 1),
            "device_of_rank0": info.get("device"),
            "model_load_s": round(info.get("model_load_s", float("nan")), 1),
            "step_s_median": statistics.median(step) if step else None,
            "tokens": sum(r["n_new_tokens"] or 0 for r in table),
            "per_rank": [{"rank": r.get("rank", 0), "model_bytes": r.get("model_bytes"),
                          "rss": r.get("memory", {}).get("VmRSS"),
                          "rss_anon": r.get("memory", {}).get("RssAnon"),
                          "rss_file": r.get("memory", {}).get("RssFile"), "peak_rss": r.get("peak_rss_bytes")}
                         for r in ranks],
        }
    one, many = gens[1], gens[a.tp]
    record["equal_generations"] = all(one[i]["generation"] == many[i]["generation"] for i in one)
    record["mismatched_ids"] = [i for i in one if one[i]["generation"] != many[i]["generation"]]
    s1, sn = record["runs"]["tp1"]["step_s_median"], record["runs"][f"tp{a.tp}"]["step_s_median"]
    record[f"step_time_ratio_tp{a.tp}_over_tp1"] = round(sn / s1, 3) if s1 and sn else None
    (out / "result.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    ray.shutdown()
    return 0 if record["equal_generations"] else 1


if __name__ == "__main__":
    sys.exit(main())
