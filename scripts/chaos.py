"""The job under a seeded schedule of faults, round after round, for as long as asked.

    python scripts/chaos.py --rows 200 --minutes 10 --seed 1 --work /tmp/chaos

Each round runs ``jobs/generate.py`` (2 replicas, batches of 4 rows, 8 greedy tokens, a tiny random
Llama) on ``--rows`` rows with ``LOGITSPEC_FAULT=chaos:SEED+ROUND:DIR`` (pipeline/replica/faults.py:
SIGKILLs, a hang, out-of-memory errors a few decode steps into a batch, slow batches), then checks what
the job must guarantee: exit 0 and complete, every row once, every row equal to the first fault-free
round's generation, ``replicas.deaths`` equal to the kills and hangs injected, and the driver's peak
RSS. Prints one JSON record: per round and in total, faults injected by kind, deaths, batches redone,
out-of-memory splits, wall time, and every check that failed (none: ``"ok": true``).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from scale_check import make_model, run  # noqa: E402

KINDS = ("kill", "hang", "oom", "slow", "fired-oom")


def make_input(path: pathlib.Path, rows: int) -> None:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Row {i}: the quick brown fox jumps over"}) + "\n"
                            for i in range(rows)))


def generations(out: pathlib.Path) -> dict:
    from pipeline.io.output import read_generations

    table = read_generations(out)
    ids = table.column("id").to_pylist()
    return {"rows": len(ids), "distinct": len(set(ids)),
            "text": dict(zip(ids, table.column("generation").to_pylist()))}


def one_round(cmd: list[str], work: pathlib.Path, k: int, fault: str | None) -> tuple[dict, dict]:
    out = work / f"out-{k}"
    os.environ.pop("LOGITSPEC_FAULT", None)
    if fault:
        os.environ["LOGITSPEC_FAULT"] = fault
    record = run(cmd + ["--output", str(out), "--overwrite"], work / f"round-{k}.log")
    summary = json.loads((out / "_summary.json").read_text()) if (out / "_summary.json").exists() else {}
    return record, {"summary": summary, **generations(out)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--minutes", type=float, default=10.0, help="start no round after this long")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", default="/tmp/chaos")
    args = p.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    make_model(work / "model")
    inp = work / f"in-{args.rows}.jsonl"
    make_input(inp, args.rows)
    cmd = [sys.executable, str(REPO / "jobs" / "generate.py"), "--input", str(inp), "--model",
           str(work / "model"), "--max-new-tokens", "8", "--actors", "2", "--max-batch-size", "4",
           "--batch-rows", "4", "--budget", "fixed", "--no-warmup", "--threads-per-actor", "1",
           "--batch-timeout", "20", "--max-replacements", "40", "--log-interval", "30", "--json"]
    t0 = time.monotonic()
    _, clean = one_round(cmd, work, 0, None)
    reference = clean["text"]
    rounds, failed = [], []
    while time.monotonic() - t0 < args.minutes * 60:
        k = len(rounds) + 1
        faults = work / f"faults-{k}"
        faults.mkdir(exist_ok=True)
        for f in faults.iterdir():
            f.unlink()
        record, got = one_round(cmd, work, k, f"chaos:{args.seed + k}:{faults}")
        injected = {kind: len(list(faults.glob(f"{kind}-*"))) for kind in KINDS}
        s = got["summary"]
        replicas, engine = s.get("replicas", {}), s.get("engine", {})
        row = {"round": k, "rc": record["rc"], "wall_s": record["wall_s"], "injected": injected,
               "deaths": replicas.get("deaths"), "batches_redone": replicas.get("batches_redone"),
               "out_of_memory_splits": engine.get("out_of_memory_splits"),
               "driver_peak_rss_bytes": record["driver_peak_rss_bytes"]}
        checks = {"exit 0 and complete": record["rc"] == 0 and s.get("complete") is True,
                  "every row once": got["rows"] == got["distinct"] == args.rows,
                  "equal to the fault-free round": got["text"] == reference,
                  "deaths = kills + hangs": replicas.get("deaths") == injected["kill"] + injected["hang"]}
        row["failed"] = [name for name, ok in checks.items() if not ok]
        failed += [f"round {k}: {name}" for name in row["failed"]]
        rounds.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    total = {kind: sum(r["injected"][kind] for r in rounds) for kind in KINDS}
    print(json.dumps({"rows": args.rows, "seed": args.seed, "minutes": round((time.monotonic() - t0) / 60, 1),
                      "rounds": len(rounds), "injected": total,
                      "deaths": sum(r["deaths"] or 0 for r in rounds),
                      "batches_redone": sum(r["batches_redone"] or 0 for r in rounds),
                      "out_of_memory_splits": sum(r["out_of_memory_splits"] or 0 for r in rounds),
                      "driver_peak_rss_bytes": [r["driver_peak_rss_bytes"] for r in rounds],
                      "failed": failed, "ok": not failed, "per_round": rounds}, indent=2))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
