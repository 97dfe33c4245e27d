"""The job at scale, measured: an N-row input of short token-id prompts, a tiny random Llama, 4 new
tokens; reports rows/s, the driver's peak RSS, part files, and the time of a rerun with nothing to do.

    python scripts/scale_check.py --rows 100000 --work /tmp/scale            # run, then rerun
    python scripts/scale_check.py --rows 10000000 --work /tmp/scale --dry-run  # plan only (--dry-run)
    python scripts/scale_check.py --rows 1000000 --work /tmp/scale --fill-synthetic  # a finished job's resume

``--fill-synthetic`` completes a stopped job's output with synthetic rows (``generation`` says so) for
the keys it lacks, then reruns the job (nothing left to do): the resume's cost at N rows without
generating them all.

Prints one JSON record. The model and input are built once under --work and reused.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def make_model(path: pathlib.Path) -> None:
    """A 2-layer random Llama with the tests' tiny BPE tokenizer (so generations decode to text)."""
    if (path / "config.json").exists():
        return
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import save_tiny_text_model

    save_tiny_text_model(path)


def make_input(path: pathlib.Path, rows: int, prompt_len: int = 12, vocab: int = 500) -> None:
    """``rows`` rows: int64 ids, prompts of ``prompt_len`` random token ids (written in 1M-row groups)."""
    if path.exists():
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, pa.schema([("id", pa.int64()), ("prompt", pa.list_(pa.int32()))])) as w:
        for start in range(0, rows, 1_000_000):
            n = min(1_000_000, rows - start)
            tokens = rng.integers(3, vocab, size=n * prompt_len, dtype=np.int32)
            offsets = pa.array(np.arange(0, n * prompt_len + 1, prompt_len, dtype=np.int32))
            prompts = pa.ListArray.from_arrays(offsets, pa.array(tokens))
            w.write_table(pa.table({"id": pa.array(np.arange(start, start + n)), "prompt": prompts}))
    tmp.rename(path)


def run(cmd: list[str], log: pathlib.Path) -> dict:
    """Run the job (output to ``log`` and ``log``.out); wall time, exit code, the driver's peak RSS
    (VmHWM, polled) and its stdout's JSON (the brief summary, or the --dry-run plan)."""
    t0 = time.perf_counter()
    with open(log, "w") as err, open(f"{log}.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:
            try:
                for line in pathlib.Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
    record = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
              "driver_peak_rss_bytes": peak}
    try:
        record["stdout"] = json.loads(pathlib.Path(f"{log}.out").read_text())
    except ValueError:
        record["stderr_tail"] = log.read_text().strip().splitlines()[-3:]
    return record


def fill_synthetic(out: pathlib.Path) -> int:
    """Write a row for every id of the stopped job's input that its output lacks; the rows written."""
    sys.path.insert(0, str(REPO))
    import pyarrow as pa

    from pipeline.io.inputs import open_input
    from pipeline.io.output import OutputStore
    from pipeline.job.config import JobConfig
    from pipeline.job.pending import pending, scan_ids
    from pipeline.rows import OutputRow

    job = json.loads((out / "_job.json").read_text())
    store = OutputStore(out, pa.int64(), part_rows=10_000)
    store.prepare(job, overwrite=False)
    cfg = JobConfig(input=str(out.parent / f"in-{out.name[4:]}.parquet"), output=str(out))
    index = scan_ids(open_input(cfg))
    missing = index.ids.filter(pa.array(pending(index, store.existing, 1).todo))
    row = {"sample": 0, "generation": "synthetic (not generated)", "finish_reason": "length",
           "n_prompt_tokens": 12, "n_new_tokens": 4, "steps": 4, "mean_accepted": 1.0,
           "accepted_lengths": [1, 1, 1, 1], "retrieval_success": 0.0, "wall_s": 0.0, "method": job["method"],
           "model": job["model"]}
    for i in missing.to_pylist():
        store.add([OutputRow(id=i, **row)])
    store.flush()
    store.close()
    return len(missing)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--work", default="/tmp/scale_check")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="only plan (jobs/generate.py --dry-run)")
    p.add_argument("--fill-synthetic", action="store_true",
                   help="complete a stopped run's output with synthetic rows, then time the rerun "
                        "(nothing to do)")
    p.add_argument("job_args", nargs="*", help="more jobs/generate.py flags (after --)")
    args = p.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    make_model(work / "model")
    inp = work / f"in-{args.rows}.parquet"
    make_input(inp, args.rows)
    out = work / f"out-{args.rows}"
    cmd = [sys.executable, str(REPO / "jobs" / "generate.py"), "--input", str(inp), "--output", str(out),
           "--model", str(work / "model"), "--max-new-tokens", "4", "--actors", str(args.actors),
           "--max-batch-size", "8", "--batch-rows", "256", "--log-interval", "30", *args.job_args]
    record: dict = {"rows": args.rows, "command": " ".join(cmd[1:])}
    if args.dry_run:
        record["dry_run"] = run(cmd + ["--dry-run"], work / f"dry-{args.rows}.log")
        print(json.dumps(record, indent=2))
        return 0
    if args.fill_synthetic:
        record["synthetic_rows"] = fill_synthetic(out)
        record["rerun_nothing_to_do"] = run(cmd, work / f"rerun-{args.rows}.log")
        summary = json.loads((out / "_summary.json").read_text())
        record.update(complete=summary["complete"], part_files=summary["output"]["part_files"],
                      plan_s=round(summary["timing"]["plan_s"], 1))
        print(json.dumps(record, indent=2))
        return 0
    record["run"] = run(cmd + ["--overwrite"], work / f"run-{args.rows}.log")
    if record["run"]["rc"] != 0:
        print(json.dumps(record, indent=2))
        return 1
    summary = json.loads((out / "_summary.json").read_text())
    record["complete"] = summary["complete"]
    record["rows_per_s"] = summary["rows_per_s"]
    record["timing"] = {k: round(v, 1) for k, v in summary["timing"].items() if isinstance(v, float)}
    record["part_files"] = len(list(out.glob("part-*.parquet")))
    record["rerun_nothing_to_do"] = run(cmd, work / f"rerun-{args.rows}.log")
    record["rerun_nothing_to_do"]["validate_s"] = round(json.loads((out / "_summary.json").read_text())
                                                        ["timing"]["validate_s"], 1)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
