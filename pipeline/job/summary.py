"""``_summary.json``: what a run did (rows, tokens, MAT, timing, replicas, memory), from the output on
disk, the run's counters and what the replicas reported about themselves."""
from __future__ import annotations

import json
import os
import platform
import time

from ..replica.pool import RunRecord
from .progress import Progress

# summary name -> key of a process's ``memory`` (pipeline.replica.resources.process_memory)
MEMORY_FIELDS = (("rss_bytes", "VmRSS"), ("pss_bytes", "Pss"), ("private_bytes", "private_bytes"),
                 ("shared_bytes", "shared_bytes"), ("rss_anon_bytes", "RssAnon"),
                 ("rss_file_bytes", "RssFile"),
                 ("rss_shmem_bytes", "RssShmem"))
# a process's model bytes by where they live (pipeline.replica.startup.model_memory)
MODEL_FIELDS = ("model_bytes", "model_private_bytes", "model_device_bytes", "model_shared_bytes",
                "model_file_bytes")


def _total(values) -> int | None:
    values = list(values)
    return sum(values) if values and all(v is not None for v in values) else None


def _processes(info: dict) -> list[dict]:
    """The info of each process of a replica (a tensor-parallel group's ranks, else the replica's own)."""
    return info.get("ranks") or [info]


# ---------------------------------------------------------------------------------------------- memory
def replica_memory(info: dict) -> dict:
    """One replica's memory at the end, summed over its processes, and what it holds of each index."""
    procs = _processes(info)
    refs: dict = {}
    for p in procs:
        for name, h in (p.get("references") or {}).items():
            r = refs.setdefault(name, {"bytes": h["bytes"], "private_bytes": 0, "shared_bytes": 0,
                                       "zero_copy": True})
            r["private_bytes"] += h["private_bytes"]
            r["shared_bytes"] += h["shared_bytes"]
            r["zero_copy"] = r["zero_copy"] and h["zero_copy"]
    mem = [p.get("memory") or {} for p in procs]
    return {"name": info["name"], "pid": info.get("pid"), "node_id": info.get("node_id"),
            "processes": len(procs),
            **{k: _total(m.get(src) for m in mem) for k, src in MEMORY_FIELDS},
            **{k: _total(p.get(k) for p in procs) for k in MODEL_FIELDS},
            "reference_zero_copy": all(r["zero_copy"] for r in refs.values()) if refs else None,
            "references": refs}


def _model_copies(reps: list[dict]) -> float | None:
    """Copies of the model on one node: each replica's parameter bytes in its private memory or on a
    GPU (copies of its own), plus one for a file or shared mapping, which the node's page cache or
    shared memory holds once however many processes map it."""
    one = reps[0]["model_bytes"]
    if not one or any(r["model_private_bytes"] is None for r in reps):
        return None
    own = sum(r["model_private_bytes"] + r["model_device_bytes"] for r in reps)
    mapped = any(r["model_shared_bytes"] or r["model_file_bytes"] for r in reps)
    return round(own / one + mapped, 3)


def _index_copies(reps: list[dict], name: str) -> float:
    """Copies of one index on one node: private copies, plus one for the object store's copy if mapped."""
    held = [r["references"][name] for r in reps if name in r["references"]]
    private = sum(h["private_bytes"] / h["bytes"] for h in held if h["bytes"])
    return round(private + any(h["shared_bytes"] for h in held), 3)


def node_memory(reps: list[dict], index_names) -> dict:
    """Per node: its replicas' processes, their summed RSS / PSS / private bytes, model and index copies."""
    by_node: dict = {}
    for r in reps:
        by_node.setdefault(r["node_id"], []).append(r)
    return {node: {"replicas": len(rs), "processes": sum(r["processes"] for r in rs),
                   **{k: _total(r[k] for r in rs) for k in ("rss_bytes", "pss_bytes", "private_bytes")},
                   "model_copies": _model_copies(rs),
                   "reference_copies": {n: _index_copies(rs, n) for n in sorted(index_names)}}
            for node, rs in sorted(by_node.items(), key=lambda kv: str(kv[0]))}


def memory_through_run(record: RunRecord) -> dict:
    """Resident memory sampled as tasks came back: per replica process (its samples, first, largest
    and last), and the driver's; a leak shows as a last far above the first."""
    def series(values: list) -> dict:
        return {"samples": len(values), "first_bytes": values[0], "max_bytes": max(values),
                "last_bytes": values[-1]} if values else {"samples": 0}
    return {"replica_processes": [{"pid": pid, **series(v)} for pid, v in record.rss.items()],
            "driver": series(record.driver_rss)}


def memory_section(references: dict, ready: list, final: list) -> dict:
    """``summary["memory"]``, measured by the replicas alive at the end (``final``)."""
    reps = [replica_memory(i) for i in final if "missing" not in i]
    nodes = node_memory(reps, references)
    copies = [n["model_copies"] for n in nodes.values()]
    ref_copies = [c for n in nodes.values() for c in n["reference_copies"].values()]
    return {
        "model_bytes_per_replica": (_total(p.get("model_bytes") for p in _processes(ready[0]))
                                    if ready else None),
        "model_copies": _total(copies) if copies else 0,
        "replicas": reps,
        "replicas_not_measured": [{"name": i["name"], "error": i["missing"]}
                                  for i in final if "missing" in i],
        "nodes": nodes,
        "nodes_with_replicas": len(nodes),
        "reference_indexes": _reference_meta(references),
        "reference_copies_per_node": max(ref_copies) if ref_copies else None,
        "reference_zero_copy": all(r["reference_zero_copy"] for r in reps) if references and reps else None,
    }


def _reference_meta(references: dict) -> dict:
    out = {}
    for name, arrays in references.items():
        meta = json.loads(bytes(arrays["__meta__"]).decode())
        out[name] = {k: meta.get(k) for k in ("source", "documents", "tokens", "bytes", "build_s",
                                              "prebuilt")}
    return out


# ---------------------------------------------------------------------------------------------- rows
def output_counts(store, data, num_samples: int = 1) -> dict:
    """What the output directory holds now: rows, covered input keys (an input id, a sample below its
    row's count: ``num_samples`` where the row says none), duplicated keys, tokens and steps (Arrow
    compute over the part files' few columns)."""
    import pyarrow.compute as pc

    from .pending import input_keys

    out = store.read_existing()
    c = {"in_output": 0, "covered": 0, "duplicates": 0, "failed": 0, "tokens": 0, "steps": 0,
         "per_corpus": {}}
    if out is None:
        return c
    keys = out.group_by(["id", "sample"]).aggregate([])
    ok = out.filter(pc.is_null(out.column("error")))
    c.update(in_output=out.num_rows, covered=input_keys(data, keys, num_samples).num_rows,
             duplicates=out.num_rows - keys.num_rows,
             failed=out.num_rows - ok.num_rows, tokens=int(pc.sum(ok.column("n_new_tokens")).as_py() or 0),
             steps=int(pc.sum(ok.column("steps")).as_py() or 0))
    corpus = pc.fill_null(ok.column("corpus"), "(none)")
    per = ok.append_column("c", corpus).group_by("c").aggregate(
        [("c", "count"), ("n_new_tokens", "sum"), ("steps", "sum")])
    columns = ("c", "c_count", "n_new_tokens_sum", "steps_sum")
    for name, n, t, st in zip(*(per.column(k).to_pylist() for k in columns)):
        c["per_corpus"][name] = {"rows": n, "tokens": t or 0, "steps": st or 0}
    return c


def _per_corpus(counts: dict, references: dict) -> dict:
    return {k: {**v, "mat": v["tokens"] / v["steps"] if v["steps"] else None, "reference": k in references}
            for k, v in sorted(counts.items())}


def _replicas(cfg, stats) -> dict:
    infos = stats.replica_info if stats else []
    keys = ("name", "pid", "node_id", "device", "dtype", "threads", "tcmalloc", "ready_s", "import_s",
            "model_load_s", "reference_attach_s", "warmup_s")
    return {"requested": cfg.actors, "started": stats.replicas_started if stats else 0,
            "deaths": stats.deaths if stats else 0, "replacements": stats.replacements if stats else 0,
            "batches_redone": stats.batches_redone if stats else 0,
            "lost": list(stats.death_log) if stats else [],  # which replica, on which node, which rows redone
            "startup": [{k: i.get(k) for k in keys} for i in infos]}


def _engine(cfg, record: RunRecord) -> dict:
    """How full the replicas' engines ran: decoding forwards, rows per forward, and that over the batch
    size."""
    mean = record.active_sum / record.batch_steps if record.batch_steps else None
    size = cfg.gen.engine.max_batch_size
    return {"stream": cfg.stream and cfg.tp == 1, "batch_steps": record.batch_steps, "mean_active": mean,
            "occupancy": mean / size if mean is not None else None, "shared_history": record.shared_history,
            "out_of_memory_splits": record.out_of_memory}


def build_summary(cfg, plan, progress: Progress, record: RunRecord, failure: BaseException | None) -> dict:
    """The summary of a run (``plan``: :class:`pipeline.job.plan.JobPlan`); written to ``_summary.json``."""
    data, store, timing, references = plan.data, plan.store, plan.timing, plan.references
    out = output_counts(store, data, cfg.num_samples)
    total_ids = data.total_keys(cfg.num_samples)  # (id, sample) keys
    gen_s = timing.get("generation_s")
    return {
        "complete": out["covered"] == total_ids and failure is None,
        "rows": {
            "total": total_ids, "input_rows": len(data), "num_samples": cfg.num_samples,
            "done_now": progress.done, "failed_now": progress.failed,
            "skipped_already_done": progress.skipped, "in_output": out["in_output"],
            "failed_in_output": out["failed"],
            "not_in_input": out["in_output"] - out["covered"] - out["duplicates"],
            "duplicates_in_output": out["duplicates"], "missing": total_ids - out["covered"],
        },
        "tokens": {"new_now": progress.tokens, "per_s": progress.tokens / gen_s if gen_s else None,
                   "in_output": out["tokens"]},
        "rows_per_s": progress.by_replicas / gen_s if gen_s else None,
        "mat": {"now": progress.mat, "output": out["tokens"] / out["steps"] if out["steps"] else None,
                "per_corpus_now": _per_corpus(progress.per_corpus, references),
                "per_corpus_output": _per_corpus(out["per_corpus"], references)},
        "timing": timing,
        "error": None if failure is None else f"{type(failure).__name__}: {failure}",
        "output": {"dir": str(store.root), "part_files": len(store.part_files()),
                   "parts_written_now": store.parts_written},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "engine": _engine(cfg, record),
        "replicas": _replicas(cfg, record.stats),
        "memory": {**memory_section(references, record.stats.replica_info if record.stats else [],
                                    record.final), "through_run": memory_through_run(record)},
        "model_path": str(plan.model_path),
        "ray": record.ray_info,
        "config": cfg.as_dict(),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }


def summary_text(summary: dict, summary_path: str) -> str:
    """A run's summary for people: rows, errors, tokens/s, MAT, time, and where the output is."""
    rows, tokens, mat, timing = summary["rows"], summary["tokens"], summary["mat"], summary["timing"]
    state = "done" if summary["complete"] else "NOT complete"
    lines = [f"{state}: {rows['total'] - rows['missing']} of {rows['total']} rows in the output "
             f"({rows['done_now']} generated now, {rows['failed_now']} failed now, "
             f"{rows['skipped_already_done']} already done; {rows['failed_in_output']} error rows in all)"]
    if tokens["new_now"]:
        per_s = f"{tokens['per_s']:.1f}" if tokens["per_s"] else "-"
        now = f"{mat['now']:.2f}" if mat["now"] else "-"
        lines.append(f"{tokens['new_now']} new tokens at {per_s} tokens/s, MAT {now} "
                     f"(tokens per target forward)")
    times = [f"{k.removesuffix('_s')} {timing[k]:.0f} s" for k in ("startup_s", "generation_s", "total_s")
             if timing.get(k) is not None]
    if times:
        lines.append("time: " + ", ".join(times))
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    out = summary["output"]["dir"]
    lines.append(f"output: {out} ({summary['output']['part_files']} part file(s); "
                 f"pandas.read_parquet({out!r})); summary: {summary_path}")
    return "\n".join(lines)
